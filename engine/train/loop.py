"""The LoRA training loop as a step iterator: :class:`TrainingRun`, and :func:`train` that drives it.

Order of work: validate paths, precision and attention kernels (constructor, before any model is
built) -> at the first ``next()``: load the model, encode the data once (cached; or take the
latents and text a caller prepared, :mod:`.prepared`), bring the frozen base to its precision,
add the fp32 LoRA, compute and install the checkpoint plan, restore the state when resuming ->
one optimizer step per ``next()`` (:func:`~.step.train_step`) -> save the LoRA, the resumable
state and ``report.json`` (all atomic).

Every entry point drives the same iterator: the CLI and the nodes through :func:`train`, the
sweep, the probe and lockstep timing (several runs interleaved one step at a time in one thread)
through :mod:`.runs`. No context manager is held across a ``yield``: grad mode, warning filters,
SDPA switches and memory trackers are entered and left inside each piece of work, so runs
interleaved in one thread cannot see each other's state.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..core.memory import PeakMemory, StepTimer
from ..core.plan import ModelPlan, count_blocks, effective_plan
from ..core.runner import SegmentRunner
from ..core.schedule import CheckpointSchedule
from .atomic import remove_stale_temporaries
from .attention_kernels import check_attention_backend, sdpa_context
from .buckets import sample_latent_shape
from .bundle import load_bundle, resolve_device, run_precision
from .config import ConfigError, TrainConfig
from .distributed import (
    Distributed,
    DistributedError,
    full_optimizer_state,
    init_distributed,
    plain_name,
    shard_model,
    shard_optimizer_state,
)
from .loading import ModelBundle
from .lora_io import add_lora, load_lora_file, load_lora_state_dict, lora_state_dict, save_lora
from .nonfinite import TrainingDiverged, TrainingStopped
from .precision import apply_base_precision, check_torchao, describe_precision, tensor_bytes
from .prepared import PreparedData
from .recovery import OutOfMemoryStop, first_cheaper, is_out_of_memory, restore_step_start, switch_schedule
from .report import REPORT_FILE, build_report, write_report
from .run_data import make_sampler, prepare_run_data
from .state import STATE_FILE, TrainingState, load_state, rng_state, save_state, set_rng_state
from .step import StepContext, StepRecord, learning_rate_at, lr_factor, train_step
from .validation import PREVIEW_FOLDER, PreviewSource, preview_source_for, previews_at, run_previews
from .watchdog import Watchdog, device_at_capacity

LORA_FILE = "lora.safetensors"
__all__ = ["LORA_FILE", "StepRecord", "TrainResult", "TrainingDiverged", "TrainingRun", "learning_rate_at",
           "load_bundle", "resolve_device", "run_precision", "train"]


@dataclass
class TrainResult:
    """What a run produced: the plan it applied, per-step records and the files written."""

    config: TrainConfig
    plan: ModelPlan
    history: list[dict[str, Any]]
    lora_path: Path
    state_path: Path
    report_path: Path
    report: dict[str, Any]
    interrupted: bool = False
    model: Any = field(default=None, repr=False)
    writer: bool = True
    """False on the ranks of a sharded run other than 0 (they wrote nothing)."""


class TrainingRun:
    """One LoRA training run as an iterator of :class:`~.step.StepRecord`, one per optimizer step.

    Usage::

        run = TrainingRun(config)
        for record in run:          # set-up happens at the first step
            if time_to_stop:
                run.stop()          # the resumable state is saved after this step
        result = run.result         # a TrainResult once the iteration ended

    Between steps the run's state can be read: :attr:`context` (model, optimizer, runner,
    sampler, memory meter, ...), :attr:`history`, :attr:`plan`, :attr:`bundle` (the model being
    trained; set before the first step when given). A consumer that abandons the iterator (closes
    it) releases the run's resources and writes nothing.

    Args:
        config: the run configuration.
        bundle: an already loaded model (its transformer gets the adapter and is brought to the
            run's base precision: pass a copy when the model is shared); default: loaded from
            ``config`` at the first step.
        log: where progress lines go.
        cache_dir: folder of the latent cache (default ``<output>/cache``); runs of the same
            data and model may share one.
        prepared: latents and text states a caller encoded (ComfyUI's encoders) instead of images.
        preview_source: what validation previews sample from (default: the validation prompts
            through the bundle's text encoder, decoded by its VAE).
        next_schedule: ``(schedule, family) -> schedule or None``, the schedule to switch to when
            a step runs out of memory with ``on_oom=switch`` (default: the first of
            :func:`~.recovery.cheaper_schedules`; the pre-flight passes the planner's first one
            predicted to fit).
        rows: train on these cache rows only (a probe of one bucket); default: every sample.
        announce: warn (``TextEncoderWarning``) when captions go through the stand-in embedder
            (short measurement runs leave it to the real run; the report says it either way).
        prepared: latents and text embeddings prepared by the caller (ComfyUI's LATENT and
            CONDITIONING, :func:`~.prepared.prepare_comfy_data`), trained on instead of scanning
            ``config.data`` (which must then be unset); the data position of the resumable state
            counts these samples.

    Raises:
        ConfigError, PrecisionError, AttentionBackendError: an option cannot run here (in the
            constructor, before any model is built).
        ConfigError: ``prepared`` together with ``config.data`` (constructor).
        ModelLoadError, DatasetError: the model or the data cannot be used (first step); prepared
            data of another family is a :class:`~.prepared.ComfyDataError`.
        TrainingStopped: a non-finite loss or LoRA gradient with ``on_nonfinite=stop``
            (:class:`~.nonfinite.TrainingDiverged`), a recompute that did not repeat its
            forward (:class:`~.step.RecomputeNotRepeatable`), or an out-of-memory error that
            could not be recovered (:class:`~.recovery.OutOfMemoryStop`); the LoRA and resumable
            state of the last good step are saved first.
    """

    def __init__(self, config: TrainConfig, *, bundle: ModelBundle | None = None,
                 log: Callable[[str], None] = print, cache_dir: str | Path | None = None,
                 prepared: PreparedData | None = None, preview_source: PreviewSource | None = None,
                 next_schedule: Callable[[CheckpointSchedule, Any], CheckpointSchedule | None] | None = None,
                 rows: list[int] | None = None, announce: bool = True):
        if prepared is not None and config.data is not None:
            raise ConfigError(f"data={config.data!r} is invalid with prepared data: allowed unset (one data source)")
        if prepared is not None and config.buckets:  # ComfyUI's LATENT is one batch of one shape
            raise ConfigError("buckets=True is invalid with prepared data (ComfyUI LATENT + CONDITIONING: one batch of "
                              "one latent shape): allowed false; bucketing needs an image folder")
        config.check_paths()
        self.config, self.log, self.output = config, log, Path(config.output)
        self.device = resolve_device(config)
        self.dist: Distributed | None = None
        if config.fsdp:  # joins the torchrun process group; ranks other than 0 stay quiet
            self.dist = init_distributed(self.device.type)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.dist.local_rank)
            if not self.dist.main:
                self.log = log = _quiet
            self.dist.local_rows(config.batch_size)  # refuses a batch that does not split evenly
        self.precision = run_precision(config, self.device)
        if self.dist is not None and self.precision.loss_scaling:  # no_change of fp16 weight files
            raise DistributedError(f"base_model_precision={config.base_model_precision!r} trains with fp16 loss "
                                   "scaling here, which is not wired for sharded gradients: allowed bf16 or fp32 "
                                   "with fsdp")
        check_torchao(self.precision.base)
        self.kernels = check_attention_backend(config.attention_backend, self.device)
        self.cache_dir = Path(cache_dir) if cache_dir else self.output / "cache"
        self.context: StepContext | None = None
        self.history: list[dict[str, Any]] = []
        self.result: TrainResult | None = None
        self.bundle, self.prepared, self.preview_source = bundle, prepared, preview_source
        self.validation_peak, self.dataset = 0, None
        self.next_schedule = next_schedule or first_cheaper
        self.rows = None if rows is None else set(rows)
        self.announce = announce
        self.switches: list[dict[str, Any]] = []
        self._stop, self._started = False, False

    def stop(self) -> None:
        """End after the current step: the resumable state is saved and the result is marked
        interrupted (unless it was the last step anyway)."""
        self._stop = True

    @property
    def plan(self) -> ModelPlan:
        """The plan applied so far (it may gain per-block fallbacks while running)."""
        return self.context.runner.plan

    @contextlib.contextmanager
    def _work(self) -> Iterator[None]:
        """The run's own state, entered for each piece of work and left before every ``yield``."""
        # Autograd must be on even when the caller runs under torch.inference_mode() (ComfyUI does).
        with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
            if self.dist is not None and not self.dist.main:  # rank 0 says it once
                warnings.simplefilter("ignore")
            # FSDP2 warns for every block returning a view, in case the caller changes it in place
            # (dropping the block's pre-backward hook); diffusers' loops do not, and
            # tests/test_fsdp.py checks that sharded gradients equal single-process ones
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            # torch's layer/RMS norms warn that bf16 input meets fp32 weights (autocast keeps
            # norms in fp32 by design); that is expected here, not a fault of the run
            warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight")
            yield

    def __iter__(self) -> Iterator[StepRecord]:
        if self._started:
            raise RuntimeError("a TrainingRun can be iterated once")
        self._started = True
        with self._work():
            start = self._set_up()
        ctx = self.context
        try:
            for step in range(start, self.config.steps):
                # where this step starts: what a stop saves as the last good step, and where a
                # step that ran out of memory starts again
                position, rng = ctx.sampler.state(), rng_state(ctx.noise_gen)
                with self._work():
                    try:
                        record = self._step(step, position, rng)
                    except TrainingStopped as exc:  # non-finite values, a recompute that differed, OOM
                        ctx.optimizer.zero_grad(set_to_none=True)
                        if step > 0:
                            self._save_state(rng, position, step)
                        self._write_outputs(interrupted=False, stopped=str(exc))
                        raise
                    self._log_step(record)
                    self._watch(record)
                    self._previews(record)  # every validation_every steps: after the step, outside its timing
                yield record
                with self._work():
                    if self._after_step(step):
                        break
        finally:
            ctx.runner.close()  # drops the host pool (a long-lived server must not keep it)
        with self._work():
            interrupted = self._stop and len(self.history) < self.config.steps
            lora_path, report = self._write_outputs(interrupted, None)
            self.log(f"wrote {lora_path}, {self.output / REPORT_FILE}, {self.output / STATE_FILE}")
            if self.dist is not None:
                self.dist.barrier()  # the files are complete before any rank returns
        self.result = TrainResult(self.config, self.plan, self.history, lora_path, self.output / STATE_FILE,
                                  self.output / REPORT_FILE, report, interrupted, ctx.model,
                                  self.dist is None or self.dist.main)

    def _step(self, step: int, position: dict[str, int], rng: dict[str, torch.Tensor]) -> StepRecord:
        """One optimizer step; when it runs out of memory and ``on_oom=switch``, the next cheaper
        schedule from the step's start (:mod:`.recovery`), as often as the ladder allows.

        Raises:
            OutOfMemoryStop: out of memory with recovery off, during the optimizer update, or with
                no cheaper schedule left.
        """
        ctx, switches = self.context, []
        while True:
            try:
                record = train_step(ctx, step)
                break
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                error, updating = str(exc).strip().splitlines()[0][:300], ctx.updating
            # the failed step's tensors are referenced by the exception's frames until here
            restore_step_start(ctx, position)
            set_rng_state(rng, ctx.noise_gen)
            old = ctx.config.schedule
            switch = self.config.on_oom == "switch" and self.dist is None  # ranks cannot retry in step
            new = None if updating or not switch else self.next_schedule(old, ctx.family)
            if new is None:
                why = ("during the optimizer update" if updating else "under fsdp (one rank cannot retry alone)"
                       if self.dist is not None else "with on_oom=stop" if not switch
                       else f"and no schedule saves more memory than {old.mode}")
                raise OutOfMemoryStop(f"step {step + 1} ran out of memory ({error}) {why}; the last good step is "
                                      "saved: resume with a cheaper schedule, smaller images or batch")
            switch_schedule(ctx, new)
            self.config = ctx.config
            switches.append({"step": step + 1, "from": old.mode, "to": new.mode, "error": error,
                             "from_schedule": old.to_dict(), "to_schedule": new.to_dict()})
            self.log(f"step {step + 1}: out of memory with {old.mode} ({error}); switched to {new.mode}, "
                     "retrying the step")
            self.log(ctx.runner.plan.render())
        record.schedule_switches = switches
        self.switches += switches
        return record

    def _watch(self, record: StepRecord) -> None:
        """Feed the watchdog; its reports (each once per run) are logged and kept in the step."""
        shape = "x".join(map(str, self.context.batch_shape))
        self.history[-1]["shape"] = shape  # the receipt's peak per phase (the record's own dict)
        record.watchdog = self.watchdog.observe(record.step, record.seconds, record.peak_bytes, shape)
        for found in record.watchdog:  # the history entry is the record's own dict: it has them too
            self.log(f"segckpt: warning: {found['message']}")

    def _set_up(self) -> int:
        """Load, encode, cast, add the LoRA, install the plan, resume; the first step's index."""
        config, device, log = self.config, self.device, self.log
        if self.dist is None or self.dist.main:
            remove_stale_temporaries(self.output)  # left by a process killed while writing
        bundle = self.bundle = self.bundle or load_bundle(config, self.precision, log)
        family = bundle.family
        # Data: encode every image once with the VAE (excluded from timing), then free the VAE;
        # or take the latents and text a caller prepared (ComfyUI's encoders). Sharded: rank 0
        # writes the cache, the others read it.
        with self.dist.main_first() if self.dist is not None else contextlib.nullcontext():
            cache, epoch = self.prepare_data()
        if self.rows is not None:
            epoch = [row for row in epoch if row in self.rows]
            if not epoch:
                raise ConfigError(f"rows={sorted(self.rows)[:8]} is invalid: allowed rows of the data's cache")
        # Model: frozen base at the run's precision (cast, or quantized layer by layer on the
        # device), then the fp32 LoRA, then the checkpoint plan.
        model = bundle.transformer
        self.base = apply_base_precision(model, self.precision, device)
        # peft initialises lora_A from torch's global generator: seed it, or two runs with one
        # seed in one process (a ComfyUI server, a sweep) would start from different adapters
        torch.manual_seed(config.seed)
        params = add_lora(model, config.lora, family.lora_targets)
        if config.init_lora and not config.resume:
            log(f"init_lora: {load_lora_file(model, config.init_lora, config.lora)} modules from {config.init_lora}")
        state = load_state(self.output) if config.resume else None
        if state is not None:  # before sharding: the saved LoRA is whole
            load_lora_state_dict(model, state.lora)
        model.to(device).train()
        plan = effective_plan(family, config.schedule, count_blocks(family, model),
                              fsdp_checkpointing=config.fsdp_activation_checkpointing)
        runner = SegmentRunner(model, family, plan).install()
        if self.dist is not None:  # the runner routes block calls; FSDP's hooks sit on the blocks
            blocks = [block for bl in family.block_lists for block in family.blocks(model, bl)]
            units = shard_model(model, blocks, config.fsdp_activation_checkpointing)
            params = [p for p in model.parameters() if p.requires_grad]  # now DTensor shards
            log(f"fsdp: {units} blocks and the root sharded over {self.dist.world_size} processes "
                f"({self.dist.backend}), {config.batch_size // self.dist.world_size} of the "
                f"{config.batch_size} images of each batch per process"
                + ("; on_oom=switch is not applied under fsdp (the processes cannot retry a step together): a "
                   "step that runs out of memory stops the run, its last good step saved"
                   if config.on_oom == "switch" else ""))
        log(plan.render())
        log(describe_precision(self.precision, self.base, self.kernels))
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        scaler = torch.amp.GradScaler(device.type, enabled=self.precision.loss_scaling)
        noise_gen = torch.Generator().manual_seed(config.seed + 1)
        sampler = make_sampler(cache, epoch, config, {})
        start = 0
        torch.manual_seed(config.seed)  # dropout and anything else drawing from the global RNG
        if state is not None:
            optimizer.load_state_dict(shard_optimizer_state(state.optimizer, params) if self.dist is not None
                                      else state.optimizer)
            if state.grad_scaler and scaler.is_enabled():
                scaler.load_state_dict(state.grad_scaler)
            set_rng_state(state.rng, noise_gen)
            sampler = make_sampler(cache, epoch, config, state.data_position)
            self.history, start = state.history, state.step
            log(f"resumed at step {start} from {self.output}")
        offloader = runner.offloader
        self.context = StepContext(
            config, model, family, runner, optimizer, scaler, sampler, cache, noise_gen, device, self.precision,
            self.kernels, PeakMemory(device, exclude=offloader.pool.is_host if offloader else None),
            StepTimer(device, warmup=config.timing_warmup_steps),
            [(plain_name(n), p) for n, p in model.named_parameters() if p.requires_grad], lr_factor(config), epoch,
            dist=self.dist)
        self._set_up_previews(bundle, cache)
        self.watchdog = Watchdog(config.timing_warmup_steps, config.watchdog_slowdown, config.watchdog_window,
                                 at_capacity=device_at_capacity(device))
        return start

    def _set_up_previews(self, bundle: ModelBundle, cache: dict[str, torch.Tensor]) -> None:
        """The source of validation previews, or none (off, an epsilon family, nothing to decode)."""
        if self.config.validation_every:
            caption = self.dataset.samples[0].caption if self.dataset is not None and self.dataset.samples else ""
            self.preview_source = preview_source_for(self.config, bundle, sample_latent_shape(cache), self.device,
                                                     self.preview_source, caption, self.log)

    def _previews(self, record: StepRecord) -> None:
        """Sample and save the previews due after ``record``'s step; their paths go in the record."""
        if self.preview_source is None or not previews_at(record.step, self.config.validation_every,
                                                          self.config.steps):
            return
        ctx = self.context

        @contextlib.contextmanager
        def kernels_and_autocast():
            with sdpa_context(self.kernels), self.precision.autocast(self.device):
                yield

        paths, peak = run_previews(ctx.model, ctx.family, self.preview_source, self.config.validation_steps,
                                   self.config.seed, self.device, kernels_and_autocast, self.output / PREVIEW_FOLDER,
                                   record.step, write=self.dist is None or self.dist.main)
        self.validation_peak = max(self.validation_peak, peak)
        self.watchdog.previews_ran(record.step)
        record.previews = [p.relative_to(self.output).as_posix() for p in paths]
        self.history[-1]["previews"] = record.previews
        self.log(f"step {record.step}: previews {', '.join(record.previews)}")

    def prepare_data(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The run's cache (latents, text; encoded once, or read from the latent cache) and the
        cache row of each position of an epoch (:func:`~.run_data.prepare_run_data`); keeps the
        data summary and text encoder description for the report. Loads the model when the run
        was given none (its VAE and text encoders encode the data).

        Raises:
            ModelLoadError, DatasetError, ComfyDataError: see the class.
        """
        bundle = self.bundle = self.bundle or load_bundle(self.config, self.precision, self.log)
        data = prepare_run_data(self.config, bundle, self.prepared, self.cache_dir, self.output, self.log,
                                self.announce)
        self.data_summary, self.text_encoder, self.dataset = data.summary, data.text_encoder, data.dataset
        return data.cache, data.epoch

    def _log_step(self, record: StepRecord) -> None:
        self.history.append(vars(record))
        offload = (f"  offload {record.offloaded_bytes / 2**20:.1f} MiB, pool {record.pool_bytes / 2**20:.1f} MiB"
                   if self.context.runner.offloader else "")
        self.log(f"step {record.step:>4}/{self.config.steps}  loss {record.loss:.4f}  lr {record.lr:.2e}  "
                 f"{record.seconds:.3f} s/step  peak {record.peak_bytes / 2**20:.1f} MiB{offload}")
        if record.skipped:
            self.log(f"step {record.step}: update skipped: {record.skipped}")

    def _after_step(self, step: int) -> bool:
        """Save the resumable state when due; True when the run stops here."""
        last = step + 1 == self.config.steps
        every = self.config.save_every and (step + 1) % self.config.save_every == 0
        if self.dist is not None:  # a signal may reach the ranks at different steps: stop together
            self._stop = not bool(self.dist.all_true(torch.tensor([0.0 if self._stop else 1.0])).item())
        if self._stop or last or every:
            self._save_state(rng_state(self.context.noise_gen), self.context.sampler.state(), step + 1)
        if self._stop and not last:
            self.log(f"interrupted after step {step + 1}: state saved, resume with --resume")
            return True
        return False

    def _save_state(self, rng: dict[str, torch.Tensor], position: dict[str, int], step: int) -> None:
        """Write the resumable state (sharded: gathered whole by every rank, written by rank 0)."""
        ctx = self.context
        lora, optimizer = lora_state_dict(ctx.model), ctx.optimizer.state_dict()
        if self.dist is not None:
            optimizer = full_optimizer_state(optimizer)
            if not self.dist.main:
                return
        save_state(TrainingState(step, position, lora, optimizer, rng, self.history, self.config.to_dict(),
                                 ctx.scaler.state_dict()), self.output)

    def _distributed_summary(self) -> dict[str, Any] | None:
        """``report.json``'s ``distributed``: processes, backend, who checkpoints (None: one process)."""
        if self.dist is None:
            return None
        return {**self.dist.to_dict(), "fsdp": True, "checkpointing": self.plan.applied_by,
                "images_per_process": self.config.batch_size // self.dist.world_size,
                "memory_scope": "rank 0 (each process holds its shard of the weights)"}

    def _write_outputs(self, interrupted: bool, stopped: str | None) -> tuple[Path, dict[str, Any]]:
        """Save the LoRA and ``report.json`` (atomic)."""
        ctx, config, bundle = self.context, self.config, self.bundle
        meta = {"family": ctx.family.name, "schedule": config.schedule.to_dict(), "steps": len(self.history),
                "base_model": bundle.source}
        writer = self.dist is None or self.dist.main
        lora_path = save_lora(ctx.model, self.output / LORA_FILE, config.lora, meta, write=writer)
        memory = {"frozen_weight_bytes": self.base.frozen_bytes,
                  "lora_bytes": sum(tensor_bytes(p) for _, p in ctx.named_params),
                  "optimizer_state_bytes": sum(tensor_bytes(t) for slots in ctx.optimizer.state.values()
                                               for t in slots.values() if isinstance(t, torch.Tensor)),
                  "validation_peak_bytes": self.validation_peak}
        setup = {"schedule_switches": self.switches, "watchdog": self.watchdog.reports,
                 "precision": {**self.precision.to_dict(), "linear_layers": self.base.linear_layers,
                               "quantized_linear_layers": self.base.quantized_linear_layers},
                 "attention_backend": list(self.kernels), "memory": memory, "stopped": stopped,
                 "dataset": self.data_summary, "text_encoder": self.text_encoder,
                 "distributed": self._distributed_summary()}
        report = build_report(config, self.plan, self.history, ctx.timer, self.device, bundle.source,
                              interrupted, setup)
        if writer:
            write_report(report, self.output)
        return lora_path, report


def train(config: TrainConfig, *, bundle: ModelBundle | None = None,
          on_step: Callable[[StepRecord, int], None] | None = None,
          should_stop: Callable[[], bool] | None = None,
          log: Callable[[str], None] = print, cache_dir: str | Path | None = None,
          prepared: PreparedData | None = None, preview_source: PreviewSource | None = None,
          next_schedule: Callable[[CheckpointSchedule, Any], CheckpointSchedule | None] | None = None) -> TrainResult:
    """Run :class:`TrainingRun` to its end.

    Args:
        config, bundle, log, cache_dir, prepared, preview_source, next_schedule: see
            :class:`TrainingRun`.
        on_step: called after every optimizer step with ``(record, total_steps)``.
        should_stop: polled after every optimizer step; when it returns True the resumable state
            is saved and the run ends cleanly (``TrainResult.interrupted``).

    Raises:
        See :class:`TrainingRun`.
    """
    run = TrainingRun(config, bundle=bundle, log=log, cache_dir=cache_dir, prepared=prepared,
                      preview_source=preview_source, next_schedule=next_schedule)
    for record in run:
        if on_step is not None:
            on_step(record, config.steps)
        if should_stop is not None and should_stop():
            run.stop()
    return run.result


def _quiet(line: str) -> None:
    """The log of ranks other than 0 of a sharded run."""
