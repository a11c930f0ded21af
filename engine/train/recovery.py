"""Recovery from out-of-memory: the next cheaper checkpoint schedule, and what an OOM looks like.

When a step runs out of memory and recovery is on (``on_oom=switch``), the run keeps the state of
its last completed step, applies the next schedule of :func:`cheaper_schedules` (or the first a
caller's policy picks, e.g. the planner's first one predicted to fit) and retries the step. The
ladder follows the documents' decision rule (docs/SCHEDULES.md "How to decide" and "Backends"):
the backends in their order ``torch-ffn``, ``torch``, ``unsloth-ffn``, ``unsloth`` (more memory
saved, more time spent, at each rung; those the family cannot run are skipped), then, with the
last backend, a lower stride (every block checkpointed) and a lower interval (a smaller region
recomputed at once), then attention offload, then streaming every block's frozen weights from host
memory (docs/STREAMING.md). Checkpointing and streaming never change the gradients, so a run
that switched equals, step for step, a run that used the new schedule from that step on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, Callable

import torch

from ..config.backends import TABLE
from ..config.schedule import CheckpointSchedule, ScheduleError, check_supported
from ..core.memory import PeakMemory
from ..families import FamilyAdapter
from .nonfinite import TrainingStopped
from .records import StepRecord
from .setup import NextSchedule, apply_checkpointing
from .state import set_rng_state
from .step import train_step


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's out-of-memory error: ``torch.OutOfMemoryError`` (CUDA,
    MPS, XPU) or the CPU allocator's ``RuntimeError`` ("can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def _rungs(schedule: CheckpointSchedule) -> Iterator[CheckpointSchedule]:
    """Every schedule below ``schedule`` on the ladder, in order (unsupported ones included)."""
    order = sorted(TABLE.values(), key=lambda b: b.preference)
    current = schedule.replace(gradient_checkpointing=True)
    if not schedule.gradient_checkpointing:
        current = current.replace(gradient_checkpointing_backend=order[0].name)
        yield current
    for backend in order:
        if backend.preference > current.backend.preference:
            current = current.replace(gradient_checkpointing_backend=backend.name)
            yield current
    if current.gradient_checkpointing_segment_stride not in (None, current.interval):
        current = current.replace(gradient_checkpointing_segment_stride=None)
        yield current
    for interval in range(current.interval - 1, 0, -1):
        current = current.replace(gradient_checkpointing_interval=interval if interval > 1 else None,
                                  gradient_checkpointing_segment_stride=None)
        yield current
    if not current.gradient_checkpointing_offload_attention:
        current = current.replace(gradient_checkpointing_offload_attention=True)
        yield current
    if not current.streams or current.weight_offload_blocks is not None:
        yield current.replace(weight_offload="stream", weight_offload_blocks=None)


def cheaper_schedules(schedule: CheckpointSchedule, family: FamilyAdapter) -> list[CheckpointSchedule]:
    """The schedules to try after ``schedule`` ran out of memory, most preferred first, each one
    the family can run (:func:`~..core.plan.check_supported`). Empty when nothing cheaper exists.

    Example: ``interval2-stride4`` (torch) on Flux gives ``interval2-stride4-unsloth-ffn``,
    ``interval2-stride4-unsloth``, ``interval2-unsloth``, ``layer-unsloth``,
    ``layer-unsloth-offload-attn``, ``layer-unsloth-offload-attn-stream``.
    """
    found = []
    for candidate in _rungs(schedule):
        try:
            check_supported(family, candidate)
        except ScheduleError:
            if not candidate.streams or not candidate.gradient_checkpointing_offload_attention:
                continue
            candidate = candidate.replace(gradient_checkpointing_offload_attention=False)  # stream without it
            try:
                check_supported(family, candidate)
            except ScheduleError:
                continue
        if candidate != schedule and candidate not in found:
            found.append(candidate)
    return found


class OutOfMemoryStop(TrainingStopped):
    """A step ran out of memory and the run could not go on (recovery off, no cheaper schedule left,
    or the optimizer update itself ran out); the last good step is saved."""


def restore_step_start(ctx, position: dict[str, int]) -> None:
    """Undo what a failed step did before its update: gradients, the data position and the loss
    scaler's per-step bookkeeping (the LoRA weights and the optimizer state are untouched until the
    update). The caller restores the random generators. Frees what the failed step left behind."""
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.updating = False
    for key, value in position.items():
        setattr(ctx.sampler, key, value)
    if ctx.scaler.is_enabled():  # an unscale_() of the failed step would refuse the retry's
        fresh = torch.amp.GradScaler(ctx.device.type, enabled=True)
        fresh.load_state_dict(ctx.scaler.state_dict())
        ctx.scaler = fresh
    gc.collect()  # the failed step's autograd graph and saved tensors
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def switch_schedule(ctx, schedule: CheckpointSchedule) -> None:
    """Install ``schedule`` on the run's model in place of the current one: a new plan and segment
    runner through :func:`~.setup.apply_checkpointing` (the old runner's host pool is released)
    and a memory meter that excludes the new pool."""
    ctx.runner.close()
    runner = ctx.runner = apply_checkpointing(ctx.model, ctx.family, schedule)
    ctx.memory = PeakMemory(ctx.device, exclude=runner.pool.is_host if runner.pool else None)
    ctx.config = ctx.config.replace(schedule=schedule)


def step_with_recovery(ctx, step: int, position: dict[str, int], rng: dict[str, torch.Tensor],
                       next_schedule: NextSchedule, off: str | None,
                       log: Callable[[str], None]) -> tuple[StepRecord, list[dict[str, Any]]]:
    """One optimizer step; when it runs out of memory, the next cheaper schedule from the step's
    start, as often as the ladder allows.

    Args:
        ctx: the run's :class:`~.step.StepContext` (its runner, config and memory meter change on a switch).
        position, rng: the sampler position and random generators at the step's start.
        next_schedule: the recovery policy (:func:`first_cheaper`, or the pre-flight's).
        off: why recovery is off (``"with on_oom=stop"``, ``"under fsdp ..."``), or None.

    Returns:
        The step's record and its switches (``{"step", "from", "to", "error", ...}``).

    Raises:
        OutOfMemoryStop: out of memory with recovery off, during the optimizer update, or with
            no cheaper schedule left.
    """
    switches: list[dict[str, Any]] = []
    while True:
        try:
            return train_step(ctx, step), switches
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            error, updating = str(exc).strip().splitlines()[0][:300], ctx.updating
        # the failed step's tensors are referenced by the exception's frames until here
        restore_step_start(ctx, position)
        set_rng_state(rng, ctx.noise_gen)
        old = ctx.config.schedule
        new = None if updating or off else next_schedule(old, ctx.family)
        if new is None:
            why = ("during the optimizer update" if updating else off or
                   f"and no schedule saves more memory than {old.mode}")
            raise OutOfMemoryStop(f"step {step + 1} ran out of memory ({error}) {why}; the last good step is "
                                  "saved: resume with a cheaper schedule, smaller images or batch")
        switch_schedule(ctx, new)
        switches.append({"step": step + 1, "from": old.mode, "to": new.mode, "error": error,
                         "from_schedule": old.to_dict(), "to_schedule": new.to_dict()})
        log(f"step {step + 1}: out of memory with {old.mode} ({error}); switched to {new.mode}, retrying the step")
        log(ctx.runner.plan.render())


def first_cheaper(schedule: CheckpointSchedule, family) -> CheckpointSchedule | None:
    """The default recovery policy: the next rung of :func:`~.recovery.cheaper_schedules`."""
    ladder = cheaper_schedules(schedule, family)
    return ladder[0] if ladder else None
