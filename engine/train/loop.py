"""The LoRA training loop as a step iterator: :class:`TrainingRun`, and :func:`train` that drives it.

Order of work: check paths, device, precision and attention kernels (constructor, before any
model is built) -> at the first ``next()`` the set-up stages of :mod:`.setup` (load the model,
prepare the data, build the trainable model through ``apply_checkpointing``, the optimizer and
the resume) -> one optimizer step per ``next()`` (:func:`~.recovery.step_with_recovery`) -> save
the LoRA, the resumable state and ``report.json`` (all atomic).

Every entry point drives the same iterator: the facade (``engine/api.py``) through :func:`train`;
the sweep, the probe and lockstep timing (several runs interleaved one step at a time in one
thread) through ``engine/measure/runs.py``. No context manager is held across a ``yield``: grad
mode, warning filters, SDPA switches and memory trackers are entered and left inside each piece
of work, so runs interleaved in one thread cannot see each other's state.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import ConfigError, TrainConfig
from ..core.memory import PeakMemory, StepTimer, free_memory
from ..core.plan import ModelPlan
from ..data.buckets import sample_latent_shape, shape_classes
from ..data.comfy_data import PreparedData
from ..data.fingerprint import input_changes, input_fingerprint
from ..data.prepare import prepare_run_data
from ..data.samplers import batch_over_data, describe_batch_over_data
from ..files.atomic import check_writable
from ..files.lock import FolderLock
from ..model.attention_kernels import check_attention_backend
from ..model.bundle import ModelBundle
from ..model.distributed import check_sharded_precision, init_distributed, plain_name
from ..model.loading import resolve_device, run_precision
from ..model.precision import check_torchao, describe_precision
from .checks import check_guidance, check_output, check_run
from .monitor import StepMonitor
from .nonfinite import TrainingDiverged, TrainingStopped
from .objectives import NoiseSchedule
from .optim import optimizer_class
from .outputs import LORA_FILE, RunFiles, TrainResult
from .previews import PreviewSource, preview_source_for
from .recovery import NextSchedule, first_cheaper, step_with_recovery
from .report import memory_section, recipe_line, recipe_section
from .setup import build_optimizer, build_trainable, load_model
from .state import load_state, read_state_header, rng_state
from .step import StepContext, StepRecord

__all__ = ["LORA_FILE", "StepRecord", "TrainResult", "TrainingDiverged", "TrainingRun", "train"]


class ResumeWarning(UserWarning):
    """A resumed run continues although its data changed (``on_data_change=new_epoch``)."""


class TrainingRun:
    """One LoRA training run as an iterator of :class:`~.step.StepRecord`, one per optimizer step
    (``for record in run: ...``; :meth:`stop` ends it after the current step, the state saved;
    :attr:`result` is the :class:`~.outputs.TrainResult` once the iteration ended). Between steps
    :attr:`context`, :attr:`history`, :attr:`plan` and :attr:`bundle` can be read; a consumer that
    abandons the iterator releases the run's resources and writes nothing.

    Args:
        config: the run configuration.
        bundle: an already loaded model (its transformer gets the adapter and the run's base
            precision: pass a copy when it is shared); default: loaded at the first step.
        log: where progress lines go.
        cache_dir: folder of the latent cache (default ``<output>/cache``), shareable by runs.
        prepared: latents and text a caller prepared (ComfyUI's LATENT and CONDITIONING,
            ``engine/data/comfy_data.py``) instead of an image folder (``data`` then unset).
        preview_source: what validation previews sample from (default: the validation prompts
            through the bundle's text encoder, decoded by its VAE).
        next_schedule: the schedule to switch to after an out-of-memory step with
            ``on_oom=switch`` (default :func:`~.recovery.first_cheaper`; the pre-flight's own).
        rows: train on these cache rows only (a probe of one bucket); default: every sample.
        announce: warn when captions go through the stand-in embedder (measurement runs do not).

    Raises:
        ConfigError, PrecisionError, AttentionBackendError: an option cannot run here (in the
            constructor, before any model is built); ``prepared`` together with ``data``.
        OutputWriteError: the output or cache folder cannot be written (in the constructor), or a
            file could not be written later (one line naming it and the last saved state, intact).
        FolderInUseError: another run holds the output folder (in the constructor; the lock is
            held until the iteration ends, or the run object is collected).
        ModelLoadError, DatasetError, ComfyDataError: the model or the data cannot be used (first step).
        TrainingStopped: a non-finite value with ``on_nonfinite=stop``, a recompute that did not
            repeat its forward, or an out-of-memory error that could not be recovered; the LoRA
            and resumable state of the last good step are saved first.
    """

    def __init__(self, config: TrainConfig, *, bundle: ModelBundle | None = None,
                 log: Callable[[str], None] = print, cache_dir: str | Path | None = None,
                 prepared: PreparedData | None = None, preview_source: PreviewSource | None = None,
                 next_schedule: NextSchedule | None = None, rows: list[int] | None = None, announce: bool = True):
        check_run(config, prepared is not None, bundle)
        self.config, self.log, self.output = config, log, Path(config.outputs.output)
        self.device, self.dist = resolve_device(config.model), None
        if config.sharding.kind:
            self._join_process_group()
        self.precision = run_precision(config.model, self.device)
        if self.dist is not None and self.dist.kind == "fsdp":
            check_sharded_precision(self.precision, config.model.base_model_precision)
        check_torchao(self.precision.base)
        self.kernels = check_attention_backend(config.model.attention_backend, self.device)
        self.cache_dir = Path(cache_dir) if cache_dir else self.output / "cache"
        self.lock = None
        if self.writer:  # a folder that cannot be written is found before any model is built
            check_writable(self.output, "output")
            check_writable(self.cache_dir, "cache_dir")
            self.lock = FolderLock(self.output, "training")
        try:
            self._finish_init(config, bundle, prepared, preview_source, next_schedule, rows, announce)
        except BaseException:  # refused: the folder is free again at once, not when this object is collected
            if self.lock is not None:
                self.lock.release()
            raise

    def _finish_init(self, config, bundle, prepared, preview_source, next_schedule, rows, announce) -> None:
        """The constructor's checks and state once the output folder's lock is held."""
        if self.lock is not None:
            check_output(config)  # again, holding the folder: no other run can have started there since
            if self.lock.took_over is not None:
                self.log(f"the lock of process {self.lock.took_over} (no longer running) on {self.output} was "
                         "released by the system; this run holds it now")
        self.bundle, self.prepared, self.preview_source = bundle, prepared, preview_source
        self.next_schedule, self.announce = next_schedule or first_cheaper, announce
        self.rows = None if rows is None else set(rows)
        self.context: StepContext | None = None
        self.history: list[dict[str, Any]] = []
        self.switches: list[dict[str, Any]] = []
        self.result: TrainResult | None = None
        self.files, self.dataset, self.random_windows = RunFiles(self.output, self.writer), None, None
        self.empty_text = None
        self._stop, self._started, self._done = False, False, None
        self.files.inputs = input_fingerprint(config, prepared)
        self.data_change = self._check_inputs() if config.outputs.resume else None

    def _check_inputs(self) -> dict[str, Any] | None:
        """Compare what the options point at now with the saved state's fingerprint: a model
        that differs is refused; data that differ are refused, or with ``on_data_change=new_epoch``
        continued from the next epoch in a fresh order (what changed is returned for the report).

        Raises:
            ConfigError: naming what changed and what is allowed.
        """
        header = read_state_header(self.output)
        data, model = input_changes(header["inputs"], self.files.inputs)
        if model:
            raise ConfigError(f"resume: {'; '.join(model)}; allowed the model the saved run trained on (or start "
                              "a new run)")
        if not data:
            return None
        where = self.config.data.folder or "the prepared data"
        if self.config.outputs.on_data_change == "refuse":
            raise ConfigError(f"resume: the data in {where} changed since the state of step {header['step']} was "
                              f"saved: {', '.join(data)}; the saved epoch position would skip or repeat images. "
                              "Allowed: the same data, or on_data_change=new_epoch (--on-data-change new_epoch) to "
                              "continue with a fresh epoch order")
        epoch = int(header["data_position"].get("epoch", 0)) + 1
        warnings.warn(f"resume: the data in {where} changed since step {header['step']} ({', '.join(data)}); "
                      f"continuing with a fresh epoch order from epoch {epoch} (on_data_change=new_epoch)",
                      ResumeWarning, stacklevel=3)
        return {"changes": data, "step": header["step"], "fresh_epoch": epoch}

    def _join_process_group(self) -> None:
        """Join the torchrun process group (FSDP or DDP); ranks other than 0 stay quiet."""
        self.dist = init_distributed(self.device.type, self.config.sharding.kind)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        if not self.dist.main:
            self.log = _quiet
        self.config.data.batch_rows(self.dist.world_size)  # refuses a global batch that does not split evenly

    @property
    def writer(self) -> bool:
        """Whether this process writes files (one process, or rank 0 of a multi-process run)."""
        return self.dist is None or self.dist.main

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
            if not self.writer:  # rank 0 says it once
                warnings.simplefilter("ignore")
            # FSDP2 warns for every block returning a view, in case the caller changes it in place
            # (dropping the block's pre-backward hook); diffusers' loops do not, and
            # tests/model/test_distributed.py checks that sharded gradients equal single-process ones
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            # torch's layer/RMS norms warn that bf16 input meets fp32 weights (autocast keeps
            # norms in fp32 by design); that is expected here, not a fault of the run
            warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight")
            yield

    def __iter__(self) -> Iterator[StepRecord]:
        if self._started:
            raise RuntimeError("a TrainingRun can be iterated once")
        self._started = True
        try:
            yield from self._run()
        finally:  # the next run may use the folder, however this one ended
            if self.lock is not None:
                self.lock.release()

    def _run(self) -> Iterator[StepRecord]:
        with self._work():
            start = self._start = self._set_up()
        ctx = self.context
        try:
            for step in range(start, self.config.steps):
                # where this step starts: what a stop saves as the last good step, and where a
                # step that ran out of memory starts again
                position, rng = ctx.sampler.state(), rng_state(ctx.noise_gen)
                with self._work():
                    record = self._step(step, position, rng)
                yield record
                with self._work():
                    if self._after_step(step):
                        break
        finally:
            ctx.runner.close()  # drops the host pool (a long-lived server must not keep it)
        with self._work():
            interrupted = self._stop and len(self.history) < self.config.steps
            state = None if self._done is None else (rng_state(ctx.noise_gen), ctx.sampler.state(), self._done)
            lora_path, report = self._write_outputs(interrupted, None, state)
            if start == self.config.steps and start > 0:
                self.log(f"nothing left to train: the run already has {start} of {self.config.steps} steps "
                         f"(raise --steps to continue it); 0 steps trained, {lora_path} is unchanged; "
                         f"wrote {self.files.report}")
            else:
                written = ", ".join(report.get("lora_files", {}).values()) or str(lora_path)
                self.log(f"wrote {written}, {self.files.report}, {self.files.state}")
            if self.dist is not None:
                self.dist.barrier()  # the files are complete before any rank returns
        self.result = TrainResult(self.config, self.plan, self.history, lora_path, self.files.state,
                                  self.files.report, report, interrupted, ctx.model, self.writer, start)

    def _step(self, step: int, position: dict[str, int], rng: dict[str, torch.Tensor]) -> StepRecord:
        """One step with out-of-memory recovery, logged, watched and followed by its previews; a
        step that cannot be applied saves the last good step and stops the run."""
        ctx, guards = self.context, self.config.guards
        off = (f"under {self.dist.kind} (one rank cannot retry alone)" if self.dist is not None
               else "with on_oom=stop" if guards.on_oom != "switch" else None)
        try:
            record, switches = step_with_recovery(ctx, step, position, rng, self.next_schedule, off, self.log)
        except TrainingStopped as exc:  # non-finite values, a recompute that differed, OOM
            ctx.optimizer.zero_grad(set_to_none=True)
            self._write_outputs(False, str(exc), (rng, position, step) if step > 0 else None)
            raise
        self.config = ctx.config  # a switch installed a cheaper schedule
        record.schedule_switches, self.switches = switches, self.switches + switches
        self.monitor.after(ctx, record, self.history)  # log, watchdog, previews: outside the step's timing
        return record

    def _set_up(self) -> int:
        """The set-up stages (:mod:`.setup`); the first step's index."""
        config, device, log = self.config, self.device, self.log
        # what the device had free before this run took any (report.json memory.device_free_bytes_at_start)
        self.device_free = free_memory(device) if device.type == "cuda" else None
        if self.device_free is not None:
            log(f"device memory free at start: {self.device_free / 2**30:.3g} GiB")
        self.files.remove_stale()  # left by a process killed while writing
        self.bundle = self.bundle or load_model(config, self.precision, log)
        check_guidance(config, self.bundle)  # its config read: a model the options could not name
        # encoded once (excluded from timing); sharded: rank 0 writes the cache, the others read it
        with self.dist.main_first() if self.dist is not None else contextlib.nullcontext():
            cache, epoch = self.prepare_data()
        if self.rows is not None:
            epoch = [row for row in epoch if row in self.rows]
            if not epoch:
                raise ConfigError(f"rows={sorted(self.rows)[:8]} is invalid: allowed rows of the data's cache")
        state = load_state(self.output) if config.outputs.resume else None
        if state is not None and self.data_change is not None:  # on_data_change=new_epoch
            state.data_position = {"epoch": self.data_change["fresh_epoch"], "index": 0}
        trainable = build_trainable(self.bundle, config, self.precision, device, state, self.dist, log)
        self.base = trainable.base
        log(trainable.runner.plan.render())
        log(describe_precision(self.precision, self.base, self.kernels))
        opt = build_optimizer(trainable, config, self.precision, device, cache, epoch, state, self.dist)
        if state is not None:
            self.history, self.files.saved_step = opt.history, opt.start
            log(f"resumed at step {opt.start} from {self.output}")
        model = trainable.model
        self.context = StepContext(
            config, model, self.bundle.family, trainable.runner, opt.optimizer, opt.scaler, opt.sampler, cache,
            opt.noise_gen, device, self.precision, self.kernels,
            PeakMemory(device, exclude=trainable.runner.pool.is_host if trainable.runner.pool else None,
                       compiled=trainable.compiled is not None),
            StepTimer(device, warmup=config.timing_warmup_steps),
            [(plain_name(n), p) for n, p in model.named_parameters() if p.requires_grad], epoch, dist=self.dist,
            random_windows=self.random_windows, compiled=trainable.compiled, empty_text=self.empty_text,
            noise=NoiseSchedule(self.bundle.family, config.objective, self.bundle.inference_shift,
                                dict(self.bundle.transformer.config)))
        for shape, _rows in shape_classes(cache):  # the shift of every bucket, before the first draw
            self.context.noise.shift_for(shape)
        log(recipe_line(recipe_section(config, self.context.noise, self.history, optimizer_class(opt.optimizer))))
        if config.validation.validation_every and (self.writer or self.dist.kind == "fsdp"):  # ddp: rank 0's own
            caption = self.dataset.samples[0].caption if self.dataset is not None and self.dataset.samples else ""
            self.preview_source = preview_source_for(config, self.bundle, sample_latent_shape(cache), device,
                                                     self.preview_source, caption, log)
        self.monitor = StepMonitor(config, device, self.output, self.preview_source, log, self.writer)
        return opt.start

    def prepare_data(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Stage 2: the run's cache (latents, text; encoded once, or read from the latent cache)
        and the cache row of each position of an epoch (``engine/data/prepare.py``); keeps the
        data summary and text encoder description for the report (with what a batch larger than
        the data does, ``engine/data/samplers.py``, logged). Loads the model when the run was given
        none (its VAE and text encoders encode the data).

        Raises:
            ModelLoadError, DatasetError, ComfyDataError: see the class.
        """
        config = self.config
        self.bundle = self.bundle or load_model(config, self.precision, self.log)
        data = prepare_run_data(config.data, config.model, config.seed, self.bundle, self.prepared, self.cache_dir,
                                self.output, self.log, self.announce)
        self.data_summary, self.text_encoder, self.dataset = data.summary, data.text_encoder, data.dataset
        self.random_windows, self.empty_text = data.random_windows, data.empty_text
        over = batch_over_data(data.cache, data.epoch, config.data.batch_rows(self.dist.world_size if self.dist else 1)[1])
        if over is not None:  # said, and counted in report.json dataset.batch_over_data
            self.data_summary = {**self.data_summary, "batch_over_data": over}
            self.log(describe_batch_over_data(over))
        return data.cache, data.epoch

    def _after_step(self, step: int) -> bool:
        """Save the resumable state when due (the last step's is written with the LoRA, after
        it); True when the run stops here."""
        last, self._done = step + 1 == self.config.steps, step + 1
        every = self.config.outputs.save_every and (step + 1) % self.config.outputs.save_every == 0
        if self.dist is not None:  # a signal may reach the ranks at different steps: stop together
            self._stop = not bool(self.dist.all_true(torch.tensor([0.0 if self._stop else 1.0])).item())
        if every and not (self._stop or last):
            self._save_state(rng_state(self.context.noise_gen), self.context.sampler.state(), step + 1)
        if self._stop and not last:
            self.log(f"interrupted after step {step + 1}: state saved, resume with --resume")
            return True
        return False

    def _save_state(self, rng: dict[str, torch.Tensor], position: dict[str, int], step: int) -> None:
        self.files.save_state(self.context, self.config, self.history, rng, position, step,
                              self.dist is not None and self.dist.kind == "fsdp",
                              self.dist.world_size if self.dist is not None else 1)

    def _write_outputs(self, interrupted: bool, stopped: str | None,
                       state: tuple[dict[str, torch.Tensor], dict[str, int], int] | None
                       ) -> tuple[Path, dict[str, Any]]:
        """Save the LoRA, then the resumable ``state`` (``(rng, position, step)``; None: none to
        save) and ``report.json`` with what the run knows of itself. The LoRA goes first: it is
        the smallest file of value, so it is kept where the disk fills up during the state."""
        ctx, config, dist = self.context, self.config, self.dist
        sections = {"schedule_switches": self.switches, "watchdog": self.monitor.watchdog.reports,
                    "precision": {**self.precision.to_dict(), "linear_layers": self.base.linear_layers,
                                  "quantized_linear_layers": self.base.quantized_linear_layers},
                    "attention_backend": list(self.kernels), "stopped": stopped,
                    "optimizer": {"name": config.optimizer.name, "class": optimizer_class(ctx.optimizer)},
                    "recipe": recipe_section(config, ctx.noise, self.history, optimizer_class(ctx.optimizer)),
                    "memory": memory_section(ctx, self.base, self.monitor.validation_peak, self.device_free),
                    "dataset": _with_windows(self.data_summary, self.random_windows), "text_encoder": self.text_encoder,
                    "compile": ctx.compiled.section(self.history) if ctx.compiled else None,
                    "resume": self.data_change and {"data_changed": self.data_change["changes"],
                                                    "from_step": self.data_change["step"],
                                                    "fresh_epoch": self.data_change["fresh_epoch"]},
                    "distributed": dist and {**dist.to_dict(), dist.kind: True, "checkpointing": self.plan.applied_by,
                                             **dict(zip(("images_per_process", "global_batch"),
                                                        config.data.batch_rows(dist.world_size))),
                                             "memory_scope": MEMORY_SCOPE[dist.kind]}}
        save_state = None if state is None else (lambda: self._save_state(*state))
        return self.files.write(ctx, config, self.plan, self.history, self.bundle.source, sections, interrupted,
                                save_state, getattr(self, "_start", 0))


def train(config: TrainConfig, *, on_step: Callable[[StepRecord, int], None] | None = None,
          should_stop: Callable[[], bool] | None = None, **run: Any) -> TrainResult:
    """Run :class:`TrainingRun` to its end.

    Args:
        config: the run. run: the other arguments of :class:`TrainingRun` (``bundle``, ``log``,
            ``cache_dir``, ``prepared``, ``preview_source``, ``next_schedule``).
        on_step: called after every optimizer step with ``(record, total_steps)``.
        should_stop: polled after every optimizer step; when it returns True the resumable state
            is saved and the run ends cleanly (``TrainResult.interrupted``).

    Raises:
        See :class:`TrainingRun`.
    """
    training = TrainingRun(config, **run)
    for record in training:
        if on_step is not None:
            on_step(record, config.steps)
        if should_stop is not None and should_stop():
            training.stop()
    return training.result


MEMORY_SCOPE = {"fsdp": "rank 0 (each process holds its shard of the weights)",
                "ddp": "rank 0 (each process holds a whole replica)"}
"""``report.json`` ``distributed.memory_scope``: what rank 0's memory figures stand for."""


def _quiet(line: str) -> None:
    """The log of ranks other than 0 of a multi-process run."""


def _with_windows(summary: dict[str, Any], windows: Any) -> dict[str, Any]:
    """The data summary with the random windows encoded when drawn (``dataset.frames.windows_encoded``)."""
    if windows is None or "frames" not in summary:
        return summary
    return {**summary, "frames": {**summary["frames"], "windows_encoded": windows.encoded}}

