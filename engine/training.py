"""The LoRA training loop: one function, :func:`train`, read top to bottom.

Order of work: validate paths, precision and attention kernels -> load the model -> encode the
data once (cached) -> bring the frozen base to its precision -> add the fp32 LoRA -> compute and
install the checkpoint plan -> restore state when resuming -> the step loop (forward, backward,
the non-finite guard, the optimizer step) -> save the LoRA, the resumable state and
``report.json`` (all atomic).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .attention_kernels import check_attention_backend, sdpa_context
from .config import TrainConfig
from .data import EpochSampler, prepare_cache, scan_folder, write_sample_dataset
from .families import TextBatch
from .loading import ModelBundle, build_preset, load_model_folder, stored_dtype
from .lora_io import add_lora, load_lora_state_dict, lora_state_dict, save_lora
from .memory import PeakMemory, StepTimer, format_mib
from .nonfinite import TrainingDiverged, check_finite, describe
from .objectives import noisy_latents
from .plan import ModelPlan, count_blocks, effective_plan
from .precision import BaseWeights, Precision, apply_base_precision, check_torchao, resolve_precision, tensor_bytes
from .report import REPORT_FILE, build_report, write_report
from .runner import SegmentRunner
from .state import STATE_FILE, TrainingState, load_state, save_state

LORA_FILE = "lora.safetensors"


@dataclass
class StepRecord:
    """One optimizer step.

    Attributes:
        step: 1-based optimizer step. loss: mean loss over the micro-batches. lr: learning rate.
        seconds: wall time of the step. peak_bytes: peak memory of the step (see report.py).
        checkpoint_calls, recomputed_blocks, recomputed_ffn: the runner's counters.
        offloaded_tensors, offloaded_bytes: what went to host memory this step.
        pool_bytes, pool_buckets: the host pool's size and distinct (size, dtype) keys after it.
        start_bytes: memory allocated when the step began (CUDA; 0 on the CPU, whose tracker
            counts only what the step creates): ``peak_bytes - start_bytes`` is the step's own
            activation and gradient memory.
        skipped: why the update of this step was dropped (``on_nonfinite=skip``, or an fp16
            loss-scale overflow), else None.
    """

    step: int
    loss: float
    lr: float
    seconds: float
    peak_bytes: int
    checkpoint_calls: int
    recomputed_blocks: int
    recomputed_ffn: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    pool_bytes: int = 0
    pool_buckets: int = 0
    start_bytes: int = 0
    skipped: str | None = None


@dataclass
class TrainResult:
    """What :func:`train` produced: the plan it applied, per-step records and the files written."""

    config: TrainConfig
    plan: ModelPlan
    history: list[dict[str, Any]]
    lora_path: Path
    state_path: Path
    report_path: Path
    report: dict[str, Any]
    interrupted: bool = False
    model: Any = field(default=None, repr=False)


def learning_rate_at(config: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then the schedule.

    Warm-up: ``lr * (step + 1) / warmup``. After it, ``constant``; ``linear`` decays to 0 at the
    last step; ``cosine`` follows ``0.5 * (1 + cos(pi * progress))`` (Loshchilov & Hutter, 2017).
    """
    lr, warm = config.learning_rate, config.lr_warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if config.lr_scheduler == "constant":
        return lr
    progress = (step - warm) / max(1, config.steps - warm)
    if config.lr_scheduler == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_device(config: TrainConfig) -> torch.device:
    """``cuda`` when asked or (``auto``) available, else ``cpu`` (``TrainConfig.check_paths``
    already refused ``cuda`` without CUDA)."""
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def run_precision(config: TrainConfig, device: torch.device) -> Precision:
    """The :class:`Precision` of ``config`` on ``device`` (reads weight headers for ``no_change``).

    Raises:
        PrecisionError: see :func:`~.precision.resolve_precision`.
    """
    stored = torch.float32
    if config.base_model_precision == "no_change" and config.model_path:
        stored = stored_dtype(config.model_path)
    return resolve_precision(config.base_model_precision, config.mixed_precision, device, stored)


def load_bundle(config: TrainConfig, precision: Precision | None = None) -> ModelBundle:
    """The model of ``config``: a local folder when ``model_path`` is set (loaded straight into
    the run's storage dtype), else the preset (random init in fp32; training casts it)."""
    precision = precision or run_precision(config, resolve_device(config))
    if config.model_path:
        bundle = load_model_folder(config.model_path, config.family, config.vae_path,
                                   config.text_encoder_path, seed=config.seed, dtype=precision.storage_dtype)
    else:
        bundle = build_preset(config.family, config.preset, seed=config.seed)
    return dataclasses.replace(bundle, base_precision=config.base_model_precision)


def _rng_state(noise_gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.random.get_rng_state(), "noise": noise_gen.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def _set_rng_state(state: dict[str, torch.Tensor], noise_gen: torch.Generator) -> None:
    torch.random.set_rng_state(state["cpu"])
    noise_gen.set_state(state["noise"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def train(config: TrainConfig, *, bundle: ModelBundle | None = None,
          on_step: Callable[[StepRecord, int], None] | None = None,
          should_stop: Callable[[], bool] | None = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train a LoRA with the segmented checkpoint schedule of ``config``.

    Args:
        config: the validated run configuration.
        bundle: an already loaded model (its transformer gets the adapter and is brought to the
            run's base precision: pass a copy when the model is shared); default: loaded from
            ``config``.
        on_step: called after every optimizer step with ``(record, total_steps)``.
        should_stop: polled after every optimizer step; when it returns True the resumable state
            is saved and the run ends cleanly (``TrainResult.interrupted``).
        log: where progress lines go.

    Returns:
        The :class:`TrainResult`; files are in ``config.output``.

    Raises:
        ConfigError, PrecisionError, AttentionBackendError: an option cannot run here (before any
            model is built).
        ModelLoadError, DatasetError: the model or the data cannot be used.
        TrainingDiverged: a non-finite loss or LoRA gradient with ``on_nonfinite=stop``; the LoRA
            and resumable state of the last good step are saved first.
    """
    config.check_paths()
    device = resolve_device(config)
    precision = run_precision(config, device)
    check_torchao(precision.base)
    kernels = check_attention_backend(config.attention_backend, device)
    # Autograd must be on even when the caller runs under torch.inference_mode() (ComfyUI does).
    with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
        # torch's layer/RMS norms warn once that bf16 input meets fp32 weights (autocast keeps
        # norms in fp32 by design); that is expected here, not a fault of the run
        warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight")
        return _train(config, Path(config.output), device, bundle, precision, kernels, on_step, should_stop, log)


@dataclass
class _Run:
    """What every step of one run uses (built once by :func:`_train`)."""

    config: TrainConfig
    model: torch.nn.Module
    family: Any
    runner: SegmentRunner
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: EpochSampler
    cache: dict[str, torch.Tensor]
    noise_gen: torch.Generator
    device: torch.device
    precision: Precision
    kernels: tuple[str, ...]
    memory: PeakMemory
    timer: StepTimer
    named_params: list[tuple[str, torch.nn.Parameter]]

    def guard_context(self) -> dict[str, Any]:
        """What the non-finite advice needs to know about this run."""
        return {"device": self.device, "precision": self.precision.to_dict(), "attention_backend": self.kernels,
                "learning_rate": self.config.learning_rate, "lora_alpha": self.config.lora.alpha,
                "lora_rank": self.config.lora.rank}


def _train(config, output, device, bundle, precision, kernels, on_step, should_stop, log) -> TrainResult:
    bundle = bundle or load_bundle(config, precision)
    family = bundle.family

    # Data: encode every image once with the VAE (excluded from timing), then free the VAE.
    data_dir = config.data or write_sample_dataset(output / "sample_data")
    samples = scan_folder(data_dir)
    cache = prepare_cache(samples, config.resolution, bundle.vae, bundle.encode_text,
                          family.video_latents, output / "cache", extra=_cache_identity(config, bundle))
    log(f"data: {len(samples)} images from {data_dir} at {config.resolution}px, "
        f"latents {tuple(cache['latents'].shape[1:])}")

    # Model: frozen base at the run's precision (cast, or quantized layer by layer on the
    # device), then the fp32 LoRA, then the checkpoint plan.
    model = bundle.transformer
    base = apply_base_precision(model, precision, device)
    # peft initialises lora_A from torch's global generator: seed it, or two runs with one seed in
    # one process (a ComfyUI server, a sweep) would start from different adapters
    torch.manual_seed(config.seed)
    params = add_lora(model, config.lora, family.lora_targets)
    model.to(device).train()
    plan = effective_plan(family, config.schedule, count_blocks(family, model))
    runner = SegmentRunner(model, family, plan).install()
    log(plan.render())
    log(_precision_line(precision, base, kernels))

    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
    noise_gen = torch.Generator().manual_seed(config.seed + 1)
    sampler = EpochSampler(len(samples), config.batch_size, config.seed)
    history: list[dict[str, Any]] = []
    start = 0
    torch.manual_seed(config.seed)  # dropout and anything else drawing from the global RNG
    if config.resume:
        state = load_state(output)
        load_lora_state_dict(model, state.lora)
        optimizer.load_state_dict(state.optimizer)
        if state.grad_scaler and scaler.is_enabled():
            scaler.load_state_dict(state.grad_scaler)
        _set_rng_state(state.rng, noise_gen)
        sampler = EpochSampler(len(samples), config.batch_size, config.seed, **state.data_position)
        history, start = state.history, state.step
        log(f"resumed at step {start} from {output}")

    offloader = runner.offloader
    run = _Run(config, model, family, runner, optimizer, scaler, sampler, cache, noise_gen, device, precision,
               kernels, PeakMemory(device, exclude=offloader.pool.is_host if offloader else None),
               StepTimer(device, warmup=config.timing_warmup_steps),
               [(n, p) for n, p in model.named_parameters() if p.requires_grad])
    interrupted, stopped = False, None
    try:
        for step in range(start, config.steps):
            # where this step starts: what a stop on non-finite values saves as the last good step
            position, rng = sampler.state(), _rng_state(noise_gen)
            try:
                record = _train_step(run, step)
            except TrainingDiverged as exc:
                optimizer.zero_grad(set_to_none=True)
                stopped = str(exc)
                if step > 0:
                    _save_state(run, output, rng, position, history, step)
                raise
            history.append(vars(record))
            offload = (f"  offload {record.offloaded_bytes / 2**20:.1f} MiB, pool "
                       f"{record.pool_bytes / 2**20:.1f} MiB" if offloader else "")
            log(f"step {record.step:>4}/{config.steps}  loss {record.loss:.4f}  lr {record.lr:.2e}  "
                f"{record.seconds:.3f} s/step  peak {record.peak_bytes / 2**20:.1f} MiB{offload}")
            if record.skipped:
                log(f"step {record.step}: update skipped: {record.skipped}")
            if on_step is not None:
                on_step(record, config.steps)
            stop = should_stop is not None and should_stop()
            last = step + 1 == config.steps
            if stop or last or (config.save_every and (step + 1) % config.save_every == 0):
                _save_state(run, output, _rng_state(noise_gen), sampler.state(), history, step + 1)
            if stop and not last:
                interrupted = True
                log(f"interrupted after step {step + 1}: state saved, resume with --resume")
                break
    finally:
        runner.close()  # drops the host pool (a long-lived server must not keep it)
        if stopped is not None:  # the LoRA and report of the last good step, then the error
            _write_outputs(run, bundle, output, history, base, interrupted, stopped)

    lora_path, report = _write_outputs(run, bundle, output, history, base, interrupted, None)
    log(f"wrote {lora_path}, {output / REPORT_FILE}, {output / STATE_FILE}")
    return TrainResult(config, runner.plan, history, lora_path, output / STATE_FILE,
                       output / REPORT_FILE, report, interrupted, model)


def _precision_line(precision: Precision, base: BaseWeights, kernels: tuple[str, ...]) -> str:
    quantized = f", {base.quantized_linear_layers}/{base.linear_layers} Linear layers quantized" \
        if precision.quantized else ""
    return (f"base: {precision.base} ({format_mib(base.frozen_bytes, 1)} frozen weights{quantized}), compute "
            f"{precision.to_dict()['compute']}, LoRA fp32; attention kernels {','.join(kernels)}")


def _write_outputs(run: _Run, bundle, output: Path, history, base: BaseWeights, interrupted: bool,
                   stopped: str | None) -> tuple[Path, dict[str, Any]]:
    """Save the LoRA and ``report.json`` (atomic); the plan may hold fallbacks found while running."""
    config = run.config
    meta = {"family": run.family.name, "schedule": config.schedule.to_dict(), "steps": len(history),
            "base_model": bundle.source}
    lora_path = save_lora(run.model, output / LORA_FILE, config.lora, meta)
    memory = {"frozen_weight_bytes": base.frozen_bytes,
              "lora_bytes": sum(tensor_bytes(p) for _, p in run.named_params),
              "optimizer_state_bytes": sum(tensor_bytes(t) for slots in run.optimizer.state.values()
                                           for t in slots.values() if isinstance(t, torch.Tensor))}
    setup = {"precision": {**run.precision.to_dict(), "linear_layers": base.linear_layers,
                           "quantized_linear_layers": base.quantized_linear_layers},
             "attention_backend": list(run.kernels), "memory": memory, "stopped": stopped}
    report = build_report(config, run.runner.plan, history, run.timer, run.device, bundle.source, interrupted, setup)
    write_report(report, output)
    return lora_path, report


def _train_step(run: _Run, step: int) -> StepRecord:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches, then the guard.

    Raises:
        TrainingDiverged: a non-finite loss or gradient with ``on_nonfinite=stop`` (before the
            optimizer step: the LoRA weights are untouched).
    """
    config, model, family, runner, device = run.config, run.model, run.family, run.runner, run.device
    lr = learning_rate_at(config, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    runner.stats.reset()
    if runner.offloader:
        runner.offloader.stats.reset()
    with run.memory.measure() as reading, run.timer.step():
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        # one SDPA kernel choice for forward, backward and every recompute inside backward
        with sdpa_context(run.kernels):
            for _ in range(config.gradient_accumulation_steps):
                index = run.sampler.next_batch()
                noisy, sigmas, target = noisy_latents(family.objective, run.cache["latents"][index],
                                                     run.noise_gen, family.shared_sigma)
                cache = run.cache
                text = TextBatch(cache["text_seq"][index], cache["text_mask"][index],
                                 cache["text_pooled"][index] if "text_pooled" in cache else None).to(device)
                noisy, sigmas, target = noisy.to(device), sigmas.to(device), target.to(device)
                with run.precision.autocast(device):
                    output = runner.forward(**family.make_inputs(model, noisy, sigmas, text))
                    prediction = family.read_output(model, output, noisy)
                loss = F.mse_loss(prediction.float(), target.float()) / config.gradient_accumulation_steps
                # checkpointed regions are recomputed (offloaded inputs copied back) in here
                run.scaler.scale(loss).backward()
                loss_sum += loss.detach()
        run.scaler.unscale_(run.optimizer)  # fp16 loss scaling only; a no-op otherwise
        check = check_finite(loss_sum, run.named_params)  # the step's one synchronisation
        skipped = None
        if check.ok or (run.scaler.is_enabled() and check.loss_finite):
            run.scaler.step(run.optimizer)  # with loss scaling an overflow is skipped here, the scale lowered
            if not check.ok:
                skipped = f"fp16 loss-scale overflow in {check.bad_module}; scale lowered"
        elif config.on_nonfinite == "stop":
            raise TrainingDiverged(describe(check, step + 1, run.guard_context()))
        else:
            skipped = describe(check, step + 1, run.guard_context())
        if run.scaler.is_enabled():
            run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)  # release gradients before the next forward
        seconds = time.perf_counter() - started
    stats, off = runner.stats, runner.offloader
    return StepRecord(step + 1, check.loss, lr, seconds, reading.peak_bytes, stats.checkpoint_calls,
                      stats.recomputed_blocks, stats.recomputed_ffn,
                      off.stats.tensors if off else 0, off.stats.bytes if off else 0,
                      off.pool.pool_bytes if off else 0, len(off.pool.keys) if off else 0,
                      reading.baseline_bytes, skipped)


def _cache_identity(config: TrainConfig, bundle: ModelBundle) -> str:
    """What the cached latents and text embeddings depend on besides the images: the family, the
    model source and its weight files (names, sizes, mtimes), and the seed (a preset's random VAE
    and the deterministic embedder are seeded)."""
    parts = [bundle.family.name, bundle.source, f"seed={config.seed}", f"text={config.text_encoder_path}"]
    for folder in (config.model_path, config.vae_path, config.text_encoder_path):
        if folder:
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file():
                    stat = path.stat()
                    parts.append(f"{path}|{stat.st_size}|{stat.st_mtime_ns}")
    return "\n".join(parts)


def _save_state(run: _Run, output: Path, rng: dict[str, torch.Tensor], position: dict[str, int],
                history: list[dict[str, Any]], step: int) -> None:
    save_state(TrainingState(step, position, lora_state_dict(run.model), run.optimizer.state_dict(), rng,
                             history, run.config.to_dict(), run.scaler.state_dict()), output)
