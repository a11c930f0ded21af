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
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import TrainConfig
from ..core.plan import ModelPlan
from ..data.fingerprint import input_fingerprint
from ..data.prepare import RunData
from ..model.bundle import ModelBundle
from ..model.loading import load_bundle
from ..model.precision import describe_precision
from .checks import check_guidance, check_output, check_resume_inputs, check_run
from .nonfinite import TrainingDiverged, TrainingStopped
from .optim import optimizer_class
from .outputs import LORA_FILE, RunFacts, RunFiles, TrainResult, run_sections
from .records import StepRecord
from .recovery import first_cheaper, step_with_recovery
from .report import recipe_line, recipe_section
from .setup import (
    RunInputs,
    RunProgress,
    build_optimizer,
    build_trainable,
    describe_processes,
    device_free,
    open_site,
    prepare_data,
    start_monitor,
    step_context,
)
from .state import load_state, rng_state
from .step import StepContext, work_context

__all__ = ["LORA_FILE", "StepRecord", "TrainResult", "TrainingDiverged", "TrainingRun", "train"]


class TrainingRun:
    """One LoRA training run as an iterator of :class:`~.records.StepRecord`, one per optimizer step
    (``for record in run: ...``; :meth:`stop` ends it after the current step, the state saved;
    :attr:`result` is the :class:`~.outputs.TrainResult` once the iteration ended). Between steps
    :attr:`context`, :attr:`history`, :attr:`plan` and :attr:`bundle` can be read; a consumer that
    abandons the iterator releases the run's resources and writes nothing.

    The run's state is held in named parts: :attr:`site` (where it runs and writes:
    :class:`~.setup.RunSite`), :attr:`inputs` (what the caller gave: :class:`RunInputs`),
    :attr:`data` (the prepared data), :attr:`context` (what every step uses), :attr:`monitor`,
    :attr:`files`, :attr:`facts` (what the report says of it) and the iteration's :class:`~.setup.RunProgress`.

    Args:
        config: the run configuration. log: where progress lines go.
        inputs: the fields of :class:`~.setup.RunInputs` (``bundle``, ``cache_dir``, ``prepared``,
            ``preview_source``, ``next_schedule``, ``rows``, ``announce``), which says what each is.

    Raises:
        TypeError: an argument that is not a field of :class:`RunInputs`.
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

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] = print, **inputs: Any):
        self.inputs = RunInputs(**inputs)
        check_run(config, self.inputs.prepared is not None, self.inputs.bundle)
        self.config = config
        self.site = open_site(config.model, config.sharding, config.data, Path(config.outputs.output),
                              self.inputs.cache_dir, log)
        try:
            self._hold_folder()
        except BaseException:  # refused: the folder is free again at once, not when this object is collected
            if self.site.lock is not None:
                self.site.lock.release()
            raise

    def _hold_folder(self) -> None:
        """The constructor's checks and state once the output folder's lock is held."""
        config, site, lock = self.config, self.site, self.site.lock
        if lock is not None:
            check_output(config)  # again, holding the folder: no other run can have started there since
            if lock.took_over is not None:
                site.log(f"the lock of process {lock.took_over} (no longer running) on {site.output} was "
                         "released by the system; this run holds it now")
        self.context: StepContext | None = None
        self.data: RunData | None = None
        self.history: list[dict[str, Any]] = []
        self.result: TrainResult | None = None
        self.files, self.facts, self._progress = RunFiles(site.output, site.writer), RunFacts(), RunProgress()
        self.files.inputs = input_fingerprint(config.data, config.model, self.inputs.prepared)
        if config.outputs.resume:
            self.facts.data_change = check_resume_inputs(site.output, self.files.inputs, config.data.folder,
                                                         config.outputs.on_data_change)

    @property
    def output(self) -> Path:
        """The output folder."""
        return self.site.output

    @property
    def bundle(self) -> ModelBundle | None:
        """The model: the one the caller gave, or the one the set-up loaded."""
        return self.inputs.bundle

    @property
    def writer(self) -> bool:
        """Whether this process writes files (one process, or rank 0 of a multi-process run)."""
        return self.site.writer

    def stop(self) -> None:
        """End after the current step: the resumable state is saved and the result is marked
        interrupted (unless it was the last step anyway)."""
        self._progress.stop = True

    @property
    def plan(self) -> ModelPlan:
        """The plan applied so far (it may gain per-block fallbacks while running)."""
        return self.context.runner.plan

    def __iter__(self) -> Iterator[StepRecord]:
        if self._progress.started:
            raise RuntimeError("a TrainingRun can be iterated once")
        self._progress.started = True
        try:
            yield from self._run()
        finally:  # the next run may use the folder, however this one ended
            if self.site.lock is not None:
                self.site.lock.release()

    def _run(self) -> Iterator[StepRecord]:
        with work_context(self.writer):
            start = self._progress.start = self._set_up()
        ctx, steps, progress = self.context, self.config.steps, self._progress
        try:
            for step in range(start, steps):
                # where this step starts: what a stop saves as the last good step, and where a
                # step that ran out of memory starts again
                position, rng = ctx.sampler.state(), rng_state(ctx.noise_gen)
                with work_context(self.writer):
                    record = self._step(step, position, rng)
                yield record
                with work_context(self.writer):
                    if self._after_step(step):
                        break
        finally:
            ctx.runner.close()  # drops the host pool (a long-lived server must not keep it)
        with work_context(self.writer):
            interrupted = progress.stop and len(self.history) < steps
            state = None if progress.done is None else (rng_state(ctx.noise_gen), ctx.sampler.state(), progress.done)
            lora_path, report = self._write_outputs(interrupted, None, state)
            if start == steps and start > 0:
                self.site.log(f"nothing left to train: the run already has {start} of {steps} steps "
                              f"(raise --steps to continue it); 0 steps trained, {lora_path} is unchanged; "
                              f"wrote {self.files.report}")
            else:
                written = ", ".join(report.get("lora_files", {}).values()) or str(lora_path)
                self.site.log(f"wrote {written}, {self.files.report}, {self.files.state}")
            if self.site.dist is not None:
                self.site.dist.barrier()  # the files are complete before any rank returns
        self.result = TrainResult(self.config, self.plan, self.history, lora_path, self.files.state,
                                  self.files.report, report, interrupted, ctx.model, self.writer, start)

    def _step(self, step: int, position: dict[str, int], rng: dict[str, torch.Tensor]) -> StepRecord:
        """One step with out-of-memory recovery, logged, watched and followed by its previews; a
        step that cannot be applied saves the last good step and stops the run."""
        ctx, dist = self.context, self.site.dist
        off = (f"under {dist.kind} (one rank cannot retry alone)" if dist is not None
               else "with on_oom=stop" if self.config.guards.on_oom != "switch" else None)
        try:
            record, switches = step_with_recovery(ctx, step, position, rng, self.inputs.next_schedule or first_cheaper,
                                                  off, self.site.log)
        except TrainingStopped as exc:  # non-finite values, a recompute that differed, OOM
            ctx.optimizer.zero_grad(set_to_none=True)
            self._write_outputs(False, str(exc), (rng, position, step) if step > 0 else None)
            raise
        self.config = ctx.config  # a switch installed a cheaper schedule
        record.schedule_switches, self.facts.switches = switches, self.facts.switches + switches
        self.monitor.after(ctx, record, self.history)  # log, watchdog, previews: outside the step's timing
        return record

    def _set_up(self) -> int:
        """The set-up stages (:mod:`.setup`); the first step's index."""
        config, site, inputs, log = self.config, self.site, self.inputs, self.site.log
        self.facts.device_free = device_free(site)  # before this run took any
        self.files.remove_stale()  # left by a process killed while writing
        bundle = inputs.bundle = inputs.bundle or load_bundle(config.model, config.seed, site.precision, log)
        check_guidance(config.objective, config.model, bundle)  # its config read: a model the options could not name
        # encoded once (excluded from timing); sharded: rank 0 writes the cache, the others read it
        with site.dist.main_first() if site.dist is not None else contextlib.nullcontext():
            cache, epoch = self.prepare_data()
        state = load_state(site.output) if config.outputs.resume else None
        if state is not None and self.facts.data_change is not None:  # on_data_change=new_epoch
            state.data_position = {"epoch": self.facts.data_change["fresh_epoch"], "index": 0}
        trainable = build_trainable(bundle, site, config.model, config.lora, config.schedule, config.sharding,
                                    config.seed, state)
        if site.dist is not None:
            log(describe_processes(trainable, bundle.family, site.dist, config.data, config.guards))
        self.facts.base = trainable.base
        log(trainable.runner.plan.render())
        log(describe_precision(site.precision, trainable.base, site.kernels))
        opt = build_optimizer(trainable, config.optimizer, config.data.batch_rows(site.world_size)[1], config.seed,
                              site, cache, epoch, state)
        if state is not None:
            self.history, self.files.saved_step = opt.history, opt.start
            log(f"resumed at step {opt.start} from {site.output}")
        self.context = step_context(config, bundle, trainable, opt, site, self.data)
        log(recipe_line(recipe_section(config.objective, config.optimizer, config.lora, config.data.caption_dropout,
                                       self.context.noise, self.history, optimizer_class(opt.optimizer))))
        self.monitor = start_monitor(config.validation, config.guards, config.timing_warmup_steps, config.data.frame_rate,
                                     site, self.inputs, self.data, cache)
        return opt.start

    def prepare_data(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Stage 2 (:func:`~.setup.prepare_data`): the run's cache and the cache row of each
        position of an epoch; the model is loaded first when the run was given none.

        Raises:
            ModelLoadError, DatasetError, ComfyDataError: see the class.
        """
        config = self.config
        self.data = prepare_data(config.data, config.model, config.seed, self.site, self.inputs)
        return self.data.cache, self.data.epoch

    def _after_step(self, step: int) -> bool:
        """Save the resumable state when due (the last step's is written with the LoRA, after
        it); True when the run stops here."""
        progress, dist, outputs = self._progress, self.site.dist, self.config.outputs
        last, progress.done = step + 1 == self.config.steps, step + 1
        every = outputs.save_every and (step + 1) % outputs.save_every == 0
        if dist is not None:  # a signal may reach the ranks at different steps: stop together
            progress.stop = not bool(dist.all_true(torch.tensor([0.0 if progress.stop else 1.0])).item())
        if every and not (progress.stop or last):
            self.files.save_state(self.context, self.history, rng_state(self.context.noise_gen),
                                  self.context.sampler.state(), step + 1)
        if progress.stop and not last:
            self.site.log(f"interrupted after step {step + 1}: state saved, resume with --resume")
            return True
        return False

    def _write_outputs(self, interrupted: bool, stopped: str | None,
                       state: tuple[dict[str, torch.Tensor], dict[str, int], int] | None
                       ) -> tuple[Path, dict[str, Any]]:
        """Save the LoRA, then the resumable ``state`` (``(rng, position, step)``; None: none to
        save) and ``report.json`` with what the run knows of itself. The LoRA goes first: it is
        the smallest file of value, so it is kept where the disk fills up during the state."""
        ctx = self.context
        sections = {**run_sections(ctx, self.facts, self.data, self.site.kernels, self.monitor, self.history),
                    "stopped": stopped}
        save_state = None if state is None else (lambda: self.files.save_state(ctx, self.history, *state))
        return self.files.write(ctx, self.history, self.bundle.source, sections, interrupted, save_state,
                                self._progress.start)


def train(config: TrainConfig, *, on_step: Callable[[StepRecord, int], None] | None = None,
          should_stop: Callable[[], bool] | None = None, **run: Any) -> TrainResult:
    """Run :class:`TrainingRun` to its end.

    Args:
        config: the run. run: the other arguments of :class:`TrainingRun` (``log`` and the fields
            of :class:`RunInputs`).
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
