"""Lockstep timing: train several schedules one optimizer step each in turn, for paired sec/step.

On a shared machine step times drift by tens of percent over a few seconds (other jobs, CPU
frequency, a virtual machine's neighbours), so two schedules timed one after the other can swap
places from run to run. :func:`lockstep_runs` trains one deep copy of the model per schedule, each
in its own thread, and lets exactly one thread run at a time: step ``k`` of the first schedule,
then step ``k`` of the second, ..., then step ``k + 1`` of the first. Neighbouring steps see the
same machine, so the ratio of their times (:func:`paired_ratio`) cancels the drift that a
sequential comparison keeps. This is the paired (interleaved) design of benchmarking practice
(e.g. Georges, Buytaert & Eeckhout, "Statistically rigorous Java performance evaluation",
OOPSLA 2007; pyperf's interleaved runs); the median of the pairs ignores the odd preempted step.

Set-up and steps are serialized (the first run's set-up and first step, then the second's, ...,
so LoRA initialisation draws the same numbers from torch's global generator as a run alone);
after its last step each thread waits until every thread finished theirs, so no thread's
teardown overlaps another's measured step. Steps that draw from the global generator (dropout)
see other numbers than alone. Thread-local torch state (grad mode, saved-tensor hooks, dispatch
modes such as the CPU memory tracker) keeps the runs apart; the GIL and the turn protocol keep
them from running at the same time.

On a CPU device every run thread is pinned to the same core (Linux ``sched_setaffinity``: two
identical runs in unpinned threads measured up to 1.5x apart on a 2-core VM, pinned within 5%)
and torch uses one intra-op thread while the runs last (the idle OpenMP team of a waiting thread
would otherwise spin on the cores the running one needs); the previous setting is restored
afterwards.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
from typing import Any, Callable

import torch

from .config import TrainConfig
from .schedule import CheckpointSchedule
from .sweep import short_run


class _Turns:
    """Round-robin turns: runner 0 step 1, runner 1 step 1, ..., runner 0 step 2, ...; a runner
    that failed or finished gives up its turns."""

    def __init__(self, count: int, steps: int):
        self.count, self.steps = count, steps
        self.done = [0] * count  # steps finished per runner
        self.alive = [True] * count
        self.condition = threading.Condition()

    def _may_run(self, runner: int, step: int) -> bool:
        return (all(self.done[j] >= step or not self.alive[j] for j in range(runner))
                and all(self.done[j] >= step - 1 or not self.alive[j] for j in range(runner + 1, self.count)))

    def wait_turn(self, runner: int, step: int) -> None:
        """Return when ``runner`` may run ``step`` (step 1 includes its set-up)."""
        with self.condition:
            self.condition.wait_for(lambda: self._may_run(runner, step))

    def finished_step(self, runner: int, step: int) -> None:
        """Called by ``runner`` after its optimizer step ``step``; returns when it may run its next
        step (or, after its last, when every runner finished theirs)."""
        with self.condition:
            self.done[runner] = step
            self.condition.notify_all()
            if step >= self.steps:
                self.condition.wait_for(lambda: all(self.done[i] >= self.steps or not self.alive[i]
                                                    for i in range(self.count)))
                return
            self.condition.wait_for(lambda: self._may_run(runner, step + 1))

    def failed(self, runner: int) -> None:
        with self.condition:
            self.alive[runner] = False
            self.condition.notify_all()


def lockstep_runs(config: TrainConfig, bundle, schedules: list[CheckpointSchedule], warmup_steps: int = 1,
                  measured_steps: int = 4, trainer: Callable[..., Any] | None = None) -> list[Any]:
    """Train one copy of ``bundle`` per schedule in lockstep (one step of each in turn).

    Args:
        config: shared run settings (see :func:`~.sweep.short_run`).
        bundle: the loaded model; never changed (each run trains a deep copy).
        schedules: the schedules to compare (at least one).
        warmup_steps: leading steps not paired (at least 1: the first step also allocates the
            optimizer state).
        measured_steps: steps after the warm-up; each run's ``history`` has their seconds.
        trainer: the training entry point (default :func:`~.training.train`).

    Returns:
        One :class:`~.training.TrainResult` per schedule, in order.

    Raises:
        ValueError: ``warmup_steps`` < 1 or ``measured_steps`` < 1 or no schedule.
        Exception: the first error raised by any run (the others finish first).
    """
    if warmup_steps < 1 or measured_steps < 1 or not schedules:
        raise ValueError(f"lockstep_runs: warmup_steps={warmup_steps}, measured_steps={measured_steps}, "
                         f"{len(schedules)} schedules: allowed warmup_steps >= 1, measured_steps >= 1, >= 1 schedule")
    from .training import resolve_device

    on_cpu = resolve_device(config).type == "cpu"
    core = _one_core() if on_cpu else None
    steps = warmup_steps + measured_steps
    turns = _Turns(len(schedules), steps)
    results: list[Any] = [None] * len(schedules)
    errors: list[BaseException | None] = [None] * len(schedules)

    def run(index: int) -> None:
        try:
            if core is not None:
                os.sched_setaffinity(0, {core})  # this thread only
            turns.wait_turn(index, 1)
            results[index] = short_run(config, bundle, schedules[index], warmup_steps, measured_steps, trainer,
                                       on_step=lambda record, total: turns.finished_step(index, record.step))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[index] = exc
        finally:
            turns.failed(index)  # finished or failed: no more turns for this runner

    threads = [threading.Thread(target=run, args=(i,), name=f"segckpt-lockstep-{i}") for i in range(len(schedules))]
    with _one_intra_op_thread() if on_cpu else contextlib.nullcontext():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


def _one_core() -> int | None:
    """One core this process may run on (None where affinity cannot be set)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return min(os.sched_getaffinity(0))


@contextlib.contextmanager
def _one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def step_seconds(result: Any, warmup_steps: int) -> list[float]:
    """Seconds of each step after ``warmup_steps`` of one run."""
    return [record["seconds"] for record in result.history[warmup_steps:]]


def paired_ratio(a: Any, b: Any, warmup_steps: int) -> float:
    """Median over measured steps ``k`` of ``seconds_a[k] / seconds_b[k]`` for two lockstep runs
    (> 1: ``a`` is slower)."""
    pairs = zip(step_seconds(a, warmup_steps), step_seconds(b, warmup_steps))
    return statistics.median(x / y for x, y in pairs)


def paired_difference(a: Any, b: Any, warmup_steps: int) -> float:
    """Median over measured steps ``k`` of ``seconds_a[k] - seconds_b[k]``, seconds."""
    pairs = zip(step_seconds(a, warmup_steps), step_seconds(b, warmup_steps))
    return statistics.median(x - y for x, y in pairs)
