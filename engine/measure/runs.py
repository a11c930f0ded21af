"""Short runs: several training runs of one model and one dataset, as a sweep, the planner's probe
and lockstep timing make them.

A :class:`RunWorkspace` is a temporary folder shared by such runs: the built-in sample photos are
written once and the latent cache is encoded once (every run of the same data and model reuses
it), and each run trains a deep copy of the model into an output folder of its own. Runs are
:class:`~..train.loop.TrainingRun` iterators, so a caller may drive several of them one step at a
time. The workspace holds a measurement's settings and model, so the measurements take it rather
than the whole config: a sweep, a plan and a pre-flight take one not yet open and open it; their
parts (the probe, the calibration, lockstep timing) take it open.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TrainConfig
from ..config.schedule import CheckpointSchedule
from ..data.comfy_data import PreparedData
from ..data.folder import write_sample_dataset
from ..train.loop import TrainingRun, TrainResult

OnStep = Callable[[int, int], None]
"""Called after every step of a measurement with ``(steps done, steps expected in all)``."""


@dataclass
class Progress:
    """What a measurement's caller hears and how it stops one: the facade's ``sweep``, ``plan`` and
    ``check_fit`` take it (``engine/api.py``).

    Attributes:
        on_step: called after every step of every run with ``(done, total)`` (see :class:`RunWorkspace`).
        should_stop: polled after every step; True raises :class:`MeasurementInterrupted` there
            (Cancel in a node, Ctrl-C on the command line: within one step).
        log: where a sweep's lines and the model's loading lines go.
        on_cell: a sweep's: called after every cell with every cell so far and the rest as
            ``not run`` (``engine/measure/sweep.py``).
    """

    on_step: OnStep | None = None
    should_stop: Callable[[], bool] | None = None
    log: Callable[[str], None] = print
    on_cell: Callable[[list], None] | None = None

StartRun = Callable[..., Any]
"""Makes one run: called like :class:`~..train.loop.TrainingRun` (``config, bundle=, log=,
cache_dir=``) and returns an iterable of step records with a ``result`` once exhausted (tests
substitute their own)."""


class MeasurementInterrupted(Exception):
    """The caller's ``should_stop`` answered True after a step: the measurement ends there."""


class PlanInterrupted(MeasurementInterrupted):
    """The planner's head-to-head measurement was interrupted (``should_stop``, or Ctrl-C):
    ``choice`` is the prediction it had made, with a note that it was not measured, for
    the caller to keep (``segckpt plan`` writes it)."""

    def __init__(self, message: str, choice):
        super().__init__(message)
        self.choice = choice


class RunWorkspace:
    """A temporary folder for short runs of one model and dataset (a context manager).

    Args:
        config: shared settings (data, resolution, batch, device, precision, ...); each run
            replaces the schedule, the steps and the output folder.
        bundle: the loaded model; never changed (each run trains a deep copy).
        start_run: makes a run (default :class:`~..train.loop.TrainingRun`).
        on_step: called after every step of every run with ``(done, total)``: the steps done so
            far and the steps the measurement expects in all, which is what it has done, what is
            left of the runs it started and what its caller said comes next (:meth:`expect`);
            when the workspace closes without an error, ``total`` equals ``done``.
        should_stop: polled after every step of every run; True raises
            :class:`MeasurementInterrupted` there (Cancel in a node, within one step).
        prepared: latents and text states a caller prepared (ComfyUI's encoders), trained on
            by every run instead of ``config.data.folder``.
    """

    def __init__(self, config: TrainConfig, bundle, start_run: StartRun | None = None,
                 on_step: OnStep | None = None, should_stop: Callable[[], bool] | None = None,
                 prepared: PreparedData | None = None):
        self.config, self.bundle, self.start_run = config, bundle, start_run or TrainingRun
        self.prepared = prepared
        self.on_step, self.should_stop = on_step, should_stop
        self._folder: tempfile.TemporaryDirectory | None = None
        self._runs = 0
        self.done, self._ahead = 0, 0
        self._live: list[_Watched] = []
        self._frames_base: dict[str, torch.Tensor] | None = None

    @property
    def total(self) -> int:
        """The steps this workspace expects in all: done, left in its started runs, announced."""
        return self.done + sum(run.left for run in self._live) + self._ahead

    def expect(self, steps: int) -> None:
        """Announce ``steps`` more steps of runs not started yet (negative: fewer); each started run
        takes its steps from them."""
        self._ahead = max(0, self._ahead + steps)

    def __enter__(self) -> "RunWorkspace":
        """Open the workspace afresh: a new temporary folder, no step done or announced yet (a
        measurement that opens it once per table starts each one from the same settings).

        Raises:
            RuntimeError: the workspace is open already.
        """
        if self._folder is not None:
            raise RuntimeError("RunWorkspace is open already: a measurement opens a workspace once at a time")
        self._folder = tempfile.TemporaryDirectory(prefix="segckpt-runs-")
        self.root = Path(self._folder.name)
        self.data = self.config.data.folder  # the sample photos are written at the first run
        self._runs = self.done = self._ahead = 0
        self._live = []
        self._frames_base = None  # the data clips are made with (``frames.use_frames``): this opening's
        return self

    def __exit__(self, *exc: Any) -> None:
        self._folder.cleanup()
        self._folder = None
        if exc[0] is None and self.on_step is not None and self.total != self.done:
            self._ahead = 0  # announced runs that did not happen (a decision made on the way)
            self.on_step(self.done, self.done)

    def fresh(self, **changes: Any) -> "RunWorkspace":
        """A new workspace (not open) of this one's model, run maker, Cancel and prepared data, its
        settings with ``changes`` (e.g. ``schedule``), whose progress counts on from this one's
        steps done: a second measurement on the same bar (the planner's per-shape pre-flight)."""
        on_step, base = self.on_step, self.done
        if on_step is not None and base:
            def counted_on(done: int, total: int) -> None:
                on_step(base + done, base + total)
        else:
            counted_on = on_step
        return RunWorkspace(self.config.replace(**changes), self.bundle, self.start_run, counted_on,
                            self.should_stop, self.prepared)

    def _config(self, **changes: Any) -> TrainConfig:
        """The shared settings for the next run: its own output folder, the workspace's data."""
        self._runs += 1
        if self.prepared is None:
            self.data = self.data or str(write_sample_dataset(self.root / "sample_data"))
        # a measurement must measure its own schedule: no guardrails (an out-of-memory error ends
        # the run, no watchdog, no nested pre-flight)
        return self.config.replace(output=str(self.root / f"run-{self._runs}"), data=self.data, resume=False,
                                   save_every=0, guardrails=None, **changes)

    def start(self, schedule: CheckpointSchedule, warmup_steps: int, measured_steps: int,
              rows: list[int] | None = None, **changes: Any) -> Any:
        """A run of ``schedule`` for ``warmup_steps + measured_steps`` steps on a fresh copy of the
        model (not started: iterate it); ``rows``: on these cache rows only (one bucket);
        ``changes``: other settings of this run (e.g. ``validation_every``)."""
        with torch.inference_mode(False):  # the copy's weights must not become inference tensors
            model = dataclasses.replace(self.bundle, transformer=copy.deepcopy(self.bundle.transformer))
        config = self._config(schedule=schedule, steps=warmup_steps + measured_steps,
                              timing_warmup_steps=warmup_steps, **changes)
        extra = {k: v for k, v in (("rows", rows), ("prepared", self.prepared)) if v is not None}
        if isinstance(self.start_run, type) and issubclass(self.start_run, TrainingRun):
            extra["announce"] = False  # the stand-in text encoder's warning is the real run's to give
        run = self.start_run(config, bundle=model, log=lambda line: None, cache_dir=self.root / "cache", **extra)
        self._ahead = max(0, self._ahead - config.steps)
        return _Watched(run, self, config.steps) if self.on_step or self.should_stop else run

    def data_cache(self) -> dict[str, torch.Tensor]:
        """The workspace's encoded data (latents, text), as every run of it trains on; encoded
        once into the shared latent cache."""
        extra = {"prepared": self.prepared} if self.prepared is not None else {}
        run = TrainingRun(self._config(), bundle=self.bundle, log=lambda line: None, cache_dir=self.root / "cache",
                          announce=False, **extra)
        with torch.inference_mode(False), torch.no_grad():
            return run.prepare_data()[0]

    def run(self, schedule: CheckpointSchedule, warmup_steps: int, measured_steps: int, **changes: Any) -> TrainResult:
        """:meth:`start` and drive the run to its end; its result (``changes``: as :meth:`start`'s)."""
        run = self.start(schedule, warmup_steps, measured_steps, **changes)
        for _ in run:
            pass
        return run.result

    def report(self) -> None:
        """Call ``on_step`` with the progress now (before a measurement's first step)."""
        if self.on_step is not None:
            self.on_step(self.done, self.total)

    def after_step(self) -> None:
        """Report a finished step; raise :class:`MeasurementInterrupted` when asked to stop."""
        self.done += 1
        if self.on_step is not None:
            self.on_step(self.done, self.total)
        if self.should_stop is not None and self.should_stop():
            raise MeasurementInterrupted("measurement interrupted after a step")


class _Watched:
    """A run whose steps report to the workspace (progress, Cancel); ``left``: its steps not run yet
    (0 once it ended, however: a run that ran out of memory drops the rest)."""

    def __init__(self, run: Any, workspace: RunWorkspace, steps: int):
        self.run, self.workspace, self.left = run, workspace, steps
        workspace._live.append(self)

    def __getattr__(self, name: str) -> Any:  # result, bundle, context, ...
        return getattr(self.run, name)

    def __iter__(self):
        try:
            for record in self.run:
                self.left = max(0, self.left - 1)
                self.workspace.after_step()
                yield record
        finally:
            self.left = 0
            if self in self.workspace._live:
                self.workspace._live.remove(self)


def peak_after_warmup(result: TrainResult, warmup_steps: int) -> int:
    """The largest peak (bytes) of a run's steps after ``warmup_steps`` (step 1 also allocates
    the optimizer state, once)."""
    return max(h.get("device_peak_bytes") or h["peak_bytes"] for h in result.history[warmup_steps:])
