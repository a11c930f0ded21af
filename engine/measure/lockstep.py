"""Lockstep timing: train several schedules one optimizer step each in turn, for paired sec/step.

On a shared machine step times drift by tens of percent over a few seconds (other jobs, CPU
frequency, a virtual machine's neighbours), so two schedules timed one after the other can swap
places from run to run. :func:`lockstep_runs` drives one training run per schedule (each a
:class:`~..train.loop.TrainingRun` iterator on its own copy of the model) round-robin in the
calling thread: step ``k`` of the first schedule, then step ``k`` of the second, ..., then step
``k + 1`` of the first. Neighbouring steps see the same machine, so the ratio of their times
(:func:`paired_ratio`) cancels the drift that a sequential comparison keeps. This is the paired
(interleaved) design of benchmarking practice (e.g. Georges, Buytaert & Eeckhout, "Statistically
rigorous Java performance evaluation", OOPSLA 2007; pyperf's interleaved runs); the median of the
pairs ignores the odd preempted step.

Set-up comes with each run's first step, in turn; every run writes its outputs only after every
run finished its steps, so no teardown overlaps a measured step. No thread, process-wide thread
count or CPU affinity is touched: a ComfyUI server's other nodes see nothing of it. Steps that
draw from torch's global generator (dropout) see other numbers than a run alone.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..config.schedule import CheckpointSchedule
from .runs import MeasurementInterrupted, RunWorkspace


def lockstep_runs(workspace: RunWorkspace, schedules: list[CheckpointSchedule], warmup_steps: int = 1,
                  measured_steps: int = 4) -> list[Any]:
    """Train one copy of the workspace's model per schedule in lockstep (one step of each in turn).

    Args:
        workspace: an open workspace (:class:`~.runs.RunWorkspace`: the shared run settings and
            the model, never changed, each run training a deep copy; its sample data and latent
            cache shared with the caller's other runs).
        schedules: the schedules to compare (at least one).
        warmup_steps: leading steps not paired (at least 1: the first step also sets the run up
            and allocates the optimizer state).
        measured_steps: steps after the warm-up; each run's ``history`` has their seconds.

    Returns:
        One :class:`~..train.loop.TrainResult` per schedule, in order.

    Raises:
        ValueError: ``warmup_steps`` < 1 or ``measured_steps`` < 1 or no schedule.
        Exception: the first error raised by any run (the others finish first).
    """
    if warmup_steps < 1 or measured_steps < 1 or not schedules:
        raise ValueError(f"lockstep_runs: warmup_steps={warmup_steps}, measured_steps={measured_steps}, "
                         f"{len(schedules)} schedules: allowed warmup_steps >= 1, measured_steps >= 1, >= 1 schedule")
    runs = [workspace.start(s, warmup_steps, measured_steps) for s in schedules]
    steps = [iter(run) for run in runs]
    live, error = list(range(len(runs))), None
    while live:  # one round: the next step of every live run, in order
        for index in list(live):
            try:
                next(steps[index])
            except StopIteration:
                live.remove(index)
            except MeasurementInterrupted:  # Cancel: every run ends now
                for other in steps:
                    other.close()
                raise
            except Exception as exc:  # noqa: BLE001 - the others finish, then the caller gets it
                live.remove(index)
                error = error or exc
    if error is not None:
        raise error
    return [run.result for run in runs]


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
