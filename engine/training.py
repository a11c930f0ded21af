"""The LoRA training loop: one function, :func:`train`, read top to bottom.

Order of work: validate paths -> load the model -> encode the data once (cached) -> add the LoRA
-> compute and install the checkpoint plan -> restore state when resuming -> the step loop ->
save the LoRA, the resumable state and ``report.json`` (all atomic).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .config import TrainConfig
from .data import EpochSampler, prepare_cache, scan_folder, write_sample_dataset
from .families import TextBatch
from .loading import ModelBundle, build_preset, load_model_folder
from .lora_io import add_lora, load_lora_state_dict, lora_state_dict, save_lora
from .memory import PeakMemory, StepTimer
from .objectives import noisy_latents
from .plan import ModelPlan, count_blocks, effective_plan
from .report import build_report, write_report
from .runner import SegmentRunner
from .state import STATE_FILE, TrainingState, load_state, save_state

LORA_FILE = "lora.safetensors"


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite; the LoRA of that step is not written."""


@dataclass
class StepRecord:
    """One optimizer step.

    Attributes:
        step: 1-based optimizer step. loss: mean loss over the micro-batches. lr: learning rate.
        seconds: wall time of the step. peak_bytes: peak memory of the step (see report.py).
        checkpoint_calls, recomputed_blocks, recomputed_ffn: the runner's counters.
        offloaded_tensors, offloaded_bytes: what went to host memory this step.
        pool_bytes, pool_buckets: the host pool's size and distinct (size, dtype) keys after it.
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


def load_bundle(config: TrainConfig) -> ModelBundle:
    """The model of ``config``: a local folder when ``model_path`` is set, else the preset."""
    if config.model_path:
        return load_model_folder(config.model_path, config.family, config.vae_path,
                                 config.text_encoder_path, seed=config.seed)
    return build_preset(config.family, config.preset, seed=config.seed)


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
        bundle: an already loaded model (its transformer gets the adapter: pass a copy when the
            model is shared); default: loaded from ``config``.
        on_step: called after every optimizer step with ``(record, total_steps)``.
        should_stop: polled after every optimizer step; when it returns True the resumable state
            is saved and the run ends cleanly (``TrainResult.interrupted``).
        log: where progress lines go.

    Returns:
        The :class:`TrainResult`; files are in ``config.output``.

    Raises:
        ConfigError: a path option is invalid (before any model is built).
        ModelLoadError, DatasetError: the model or the data cannot be used.
    """
    config.check_paths()
    output = Path(config.output)
    # Autograd must be on even when the caller runs under torch.inference_mode() (ComfyUI does).
    with torch.inference_mode(False), torch.enable_grad():
        return _train(config, output, bundle, on_step, should_stop, log)


def _train(config, output, bundle, on_step, should_stop, log) -> TrainResult:
    device = resolve_device(config)
    bf16 = config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext())
    bundle = bundle or load_bundle(config)
    family = bundle.family

    # Data: encode every image once with the VAE (excluded from timing), then free the VAE.
    data_dir = config.data or write_sample_dataset(output / "sample_data")
    samples = scan_folder(data_dir)
    cache = prepare_cache(samples, config.resolution, bundle.vae, bundle.encode_text,
                          family.video_latents, output / "cache", extra=_cache_identity(config, bundle))
    log(f"data: {len(samples)} images from {data_dir} at {config.resolution}px, "
        f"latents {tuple(cache['latents'].shape[1:])}")

    # Model: frozen base + LoRA (fp32 weights; bf16 autocast on CUDA), then the checkpoint plan.
    model = bundle.transformer
    # peft initialises lora_A from torch's global generator: seed it, or two runs with one seed in
    # one process (a ComfyUI server, a sweep) would start from different adapters
    torch.manual_seed(config.seed)
    params = add_lora(model, config.lora, family.lora_targets)
    model.to(device).train()
    plan = effective_plan(family, config.schedule, count_blocks(family, model))
    runner = SegmentRunner(model, family, plan).install()
    log(plan.render())

    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    noise_gen = torch.Generator().manual_seed(config.seed + 1)
    sampler = EpochSampler(len(samples), config.batch_size, config.seed)
    history: list[dict[str, Any]] = []
    start = 0
    torch.manual_seed(config.seed)  # dropout and anything else drawing from the global RNG
    if config.resume:
        state = load_state(output)
        load_lora_state_dict(model, state.lora)
        optimizer.load_state_dict(state.optimizer)
        _set_rng_state(state.rng, noise_gen)
        sampler = EpochSampler(len(samples), config.batch_size, config.seed, **state.data_position)
        history, start = state.history, state.step
        log(f"resumed at step {start} from {output}")

    offloader = runner.offloader
    memory = PeakMemory(device, exclude=offloader.pool.is_host if offloader else None)
    timer = StepTimer(device, warmup=config.timing_warmup_steps)
    interrupted = False
    try:
        for step in range(start, config.steps):
            record = _train_step(config, step, model, family, runner, optimizer, sampler, cache,
                                 noise_gen, device, autocast, memory, timer)
            history.append(vars(record))
            offload = (f"  offload {record.offloaded_bytes / 2**20:.1f} MiB, pool "
                       f"{record.pool_bytes / 2**20:.1f} MiB" if offloader else "")
            log(f"step {record.step:>4}/{config.steps}  loss {record.loss:.4f}  lr {record.lr:.2e}  "
                f"{record.seconds:.3f} s/step  peak {record.peak_bytes / 2**20:.1f} MiB{offload}")
            if on_step is not None:
                on_step(record, config.steps)
            stop = should_stop is not None and should_stop()
            last = step + 1 == config.steps
            if stop or last or (config.save_every and (step + 1) % config.save_every == 0):
                _save_state(config, output, model, optimizer, noise_gen, sampler, history, step + 1)
            if stop and not last:
                interrupted = True
                log(f"interrupted after step {step + 1}: state saved, resume with --resume")
                break
    finally:
        runner.close()  # drops the host pool (a long-lived server must not keep it)

    plan = runner.plan  # may hold per-block fallbacks found while running
    meta = {"family": family.name, "schedule": config.schedule.to_dict(), "steps": len(history),
            "base_model": bundle.source}
    lora_path = save_lora(model, output / LORA_FILE, config.lora, meta)
    report = build_report(config, plan, history, timer, device, bundle.source, interrupted)
    report_path = write_report(report, output)
    log(f"wrote {lora_path}, {report_path}, {output / STATE_FILE}")
    return TrainResult(config, plan, history, lora_path, output / STATE_FILE,
                       report_path, report, interrupted, model)


def _train_step(config, step, model, family, runner, optimizer, sampler, cache, noise_gen, device,
                autocast, memory, timer) -> StepRecord:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
    lr = learning_rate_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    runner.stats.reset()
    if runner.offloader:
        runner.offloader.stats.reset()
    with memory.measure() as reading, timer.step():
        started = time.perf_counter()
        loss_sum = 0.0
        for _ in range(config.gradient_accumulation_steps):
            index = sampler.next_batch()
            noisy, sigmas, target = noisy_latents(family.objective, cache["latents"][index], noise_gen,
                                                 family.shared_sigma)
            text = TextBatch(cache["text_seq"][index], cache["text_mask"][index],
                             cache["text_pooled"][index] if "text_pooled" in cache else None).to(device)
            noisy, sigmas, target = noisy.to(device), sigmas.to(device), target.to(device)
            with autocast:
                output = runner.forward(**family.make_inputs(model, noisy, sigmas, text))
                prediction = family.read_output(model, output, noisy)
            loss = F.mse_loss(prediction.float(), target.float()) / config.gradient_accumulation_steps
            if not math.isfinite(loss.item()):  # stop before the optimizer writes NaN into the LoRA
                raise TrainingDiverged(
                    f"loss is {loss.item()} at step {step + 1}: training diverged (learning_rate="
                    f"{config.learning_rate}, lora_alpha={config.lora.alpha}); the last saved state "
                    "is kept. Lower the learning rate or alpha.")
            loss.backward()  # checkpointed regions are recomputed (offloaded inputs copied back) here
            loss_sum += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # release gradients before the next forward
        seconds = time.perf_counter() - started
    stats, off = runner.stats, runner.offloader
    return StepRecord(step + 1, loss_sum, lr, seconds, reading.peak_bytes, stats.checkpoint_calls,
                      stats.recomputed_blocks, stats.recomputed_ffn,
                      off.stats.tensors if off else 0, off.stats.bytes if off else 0,
                      off.pool.pool_bytes if off else 0, len(off.pool.keys) if off else 0)


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


def _save_state(config, output, model, optimizer, noise_gen, sampler, history, step) -> None:
    save_state(TrainingState(step, sampler.state(), lora_state_dict(model), optimizer.state_dict(),
                             _rng_state(noise_gen), history, config.to_dict()), output)
