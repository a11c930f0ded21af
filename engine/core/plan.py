"""The effective per-block plan of a model: the one function every entry point reports from.

:func:`plan_block_list` is the pure pattern of one block list (segments ``[k*S, k*S+N)``);
:func:`effective_plan` applies the family rules (docs/SCHEDULES.md "Family rules") to a
:class:`~..config.schedule.CheckpointSchedule`: a family without interval support warns and runs
per-block; a family that ignores the stride warns and drops it; a block list that the model's
loop never routes through the checkpoint function is reported as such. The result is a
:class:`ModelPlan`, one :class:`ListPlan` per block list.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..config.backends import DEFAULT as DEFAULT_BACKEND
from ..config.backends import PLAIN, PLAIN_ATTENTION_OFFLOADED, PLAIN_MARKS, RESIDENT, STREAM_MARKS, STREAMED
from ..config.backends import TABLE as BACKEND_TABLE
from ..config.schedule import CheckpointSchedule, ScheduleError, check_supported
from ..families.base import FamilyAdapter


class ScheduleWarning(UserWarning):
    """A schedule key was ignored or changed for a family or block list; the plan's notes say why."""


RUNNER = "segment runner"
FSDP_WRAPPER = "fsdp checkpoint_wrapper"
"""Who applies a plan (:attr:`ModelPlan.applied_by`): the engine's :class:`~.runner.SegmentRunner`
through diffusers' checkpoint hook, or FSDP-style ``checkpoint_wrapper`` around every block
(``fsdp_activation_checkpointing``; the runner then checkpoints nothing)."""
BLOCK_MARKS = tuple(mark for backend in sorted(BACKEND_TABLE.values(), key=lambda b: (b.ffn_scope, b.offload_inputs))
                    for mark in backend.marks) + PLAIN_MARKS
"""Every mark of :meth:`ModelPlan.block_maps`, in legend order: the backends' (whole-block before
FFN-scope, on-device before offloaded), then the plain blocks'. Declared in the backend table and
engine/config/backends.py only."""
LEGEND = ", ".join(f"{mark.char} = {mark.text}" for mark in BLOCK_MARKS)
"""Legend of :meth:`ModelPlan.block_maps`, as the printed plan shows it."""
STREAM_LEGEND = f"{STREAMED.char} = {STREAMED.text}, {RESIDENT} = frozen weights resident on the device"
"""Legend of :meth:`ModelPlan.stream_maps` (``weight_offload=stream``)."""


@dataclass(frozen=True)
class ModelPlan:
    """The effective plan of every block list of one model.

    Attributes:
        family: family name.
        schedule: the schedule as applied: the one asked for, with ``weight_offload_blocks``
            above the blocks the runner sees lowered to the number that stream (noted), so that
            its :attr:`mode` names how many stream.
        lists: one plan per block list, in forward order.
        notes: model-level notes (keys ignored, fallbacks).
        applied_by: :data:`RUNNER` or :data:`FSDP_WRAPPER`.
    """

    family: str
    schedule: CheckpointSchedule
    lists: tuple[ListPlan, ...]
    notes: tuple[str, ...] = ()
    applied_by: str = RUNNER

    @property
    def mode(self) -> str:
        """The schedule's short name (``interval 2 stride 4``, ...), or ``fsdp-layer`` when
        FSDP's ``checkpoint_wrapper`` applies the plan."""
        return "fsdp-layer" if self.applied_by == FSDP_WRAPPER else self.schedule.mode

    def list_plan(self, name: str) -> ListPlan:
        """The plan of the block list called ``name``.

        Raises:
            KeyError: no such list.
        """
        for plan in self.lists:
            if plan.name == name:
                return plan
        raise KeyError(f"block list {name!r} not in plan of {self.family}")

    @property
    def checkpointed_blocks(self) -> int:
        """Total number of checkpointed blocks (= block recomputes per backward)."""
        return sum(len(p.checkpointed) for p in self.lists)

    def with_per_block(self, list_name: str, reason: str) -> "ModelPlan":
        """A copy where ``list_name`` falls back to per-block checkpointing, with ``reason`` noted."""
        lists = []
        for plan in self.lists:
            if plan.name == list_name:
                checkpointed = plan.checkpointed
                plan = replace(plan, segments=tuple((i, i + 1) for i in checkpointed), notes=plan.notes + (reason,))
            lists.append(plan)
        return replace(self, lists=tuple(lists))

    @property
    def streamed_blocks(self) -> int:
        """Total number of blocks whose frozen weights stream from host memory."""
        return sum(len(p.streamed) for p in self.lists)

    def stream_units(self) -> list[tuple[tuple[int, int], ...]]:
        """The streamed blocks grouped into what is copied at once, in forward order, as
        ``(list index, block index)`` tuples: the streamed blocks of one whole-block segment, or
        one block that runs plainly (or with only its FFN checkpointed)."""
        ffn_scope = self.schedule.gradient_checkpointing and self.schedule.backend.ffn_scope
        units = []
        for li, lp in enumerate(self.lists):
            ends = {} if ffn_scope else dict(lp.segments)
            streamed, bi = set(lp.streamed), 0
            while bi < lp.num_blocks:
                end = ends.get(bi, bi + 1)
                members = tuple((li, b) for b in range(bi, end) if b in streamed)
                if members:
                    units.append(members)
                bi = end
        return units

    def stream_maps(self) -> dict[str, str]:
        """Per list, one character per block: ``S`` streamed frozen weights, ``.`` resident
        (see :data:`STREAM_LEGEND`); empty when nothing streams."""
        if not self.streamed_blocks:
            return {}
        return {p.name: "".join(STREAMED.char if i in set(p.streamed) else RESIDENT for i in range(p.num_blocks))
                for p in self.lists}

    def effect(self) -> tuple:
        """What the plan does, block by block, as a hashable value: two plans with equal effects run
        the same way, whatever keys they came from (the sweep's "option may not have taken effect"
        note, engine/measure/sweep.py).

        Per list, per block: ``(region, scope, offload_inputs, save_attention, offload_attention,
        streamed)``: the whole-block checkpoint segment ``(start, end)`` holding the block (None
        when it runs plainly), what is checkpointed (``"block"``, ``"ffn"`` or None), whether the
        region's boundary inputs wait in host memory, whether it keeps its attention outputs,
        whether its attention activations are offloaded (a plain block's, or every block's under an
        FFN-scope backend: engine/core/runner.py), whether its frozen weights stream; then who
        applies the plan and the streaming prefetch (None without streaming).
        """
        schedule = self.schedule
        backend = schedule.backend if schedule.gradient_checkpointing else None
        ffn = bool(backend and backend.ffn_scope)
        lists = []
        for lp in self.lists:
            region = {} if ffn else {i: (s, e) for s, e in lp.segments for i in range(s, e)}
            checkpointed, streamed = set(lp.checkpointed), set(lp.streamed)
            blocks = []
            for i in range(lp.num_blocks):
                scope = ("ffn" if ffn else "block") if i in checkpointed else None
                blocks.append((region.get(i), scope, bool(scope and backend.offload_inputs),
                               scope == "block" and schedule.gradient_checkpointing_save_attention,
                               schedule.gradient_checkpointing_offload_attention and lp.routed and scope != "block",
                               i in streamed))
            lists.append((lp.name, tuple(blocks)))
        prefetch = schedule.weight_offload_prefetch if self.streamed_blocks else None
        return tuple(lists), self.applied_by, prefetch

    def block_maps(self) -> dict[str, str]:
        """Per list, one character per block (see :data:`BLOCK_MARKS`)."""
        backend = self.schedule.backend
        mark = backend.save_attention_mark if self.schedule.gradient_checkpointing_save_attention else backend.mark
        maps = {}
        for plan in self.lists:
            plain = PLAIN_ATTENTION_OFFLOADED if self.schedule.gradient_checkpointing_offload_attention and plan.routed \
                else PLAIN
            maps[plan.name] = plan.block_map(mark.char, plain.char)
        return maps

    def render(self) -> str:
        """Per-list block map, e.g. ``double  CC..CC..  segments: 0-1 4-5``, plus the legend."""
        maps = self.block_maps()
        width = max([len(p.name) for p in self.lists] + [4])
        by = f", applied by {self.applied_by}" if self.applied_by != RUNNER else ""
        streams = self.stream_maps()
        lines = [f"plan ({self.family}, {self.mode}{by}):"]
        for plan in self.lists:
            segs = " ".join(f"{s}-{e - 1}" if e - s > 1 else f"{s}" for s, e in plan.segments) or "none"
            lines.append(f"  {plan.name:<{width}}  {maps[plan.name]}  segments: {segs}")
            if streams:
                lines.append(f"  {'':<{width}}  {streams[plan.name]}  weights streamed: {len(plan.streamed)} of "
                             f"{plan.num_blocks}")
            lines.extend(f"  {'':<{width}}  note: {note}" for note in plan.notes)
        lines.extend(f"  note: {note}" for note in self.notes)
        lines.append(f"  legend: {LEGEND}")
        if streams:
            lines.append(f"  weights: {STREAM_LEGEND}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: family, schedule keys, lists (segments, checkpointed, plain), notes, and
        the block and stream maps with their legends: ``marks`` / ``stream_marks`` map every mark
        of :data:`BLOCK_MARKS` / :data:`~..config.backends.STREAM_MARKS`, in legend order, to
        ``{"color": "#rrggbb", "label": ...}``, what the schedule node's strip draws
        (web/schedule_strip.js)."""
        return {
            "family": self.family,
            "mode": self.mode,
            "applied_by": self.applied_by,
            "schedule": self.schedule.to_dict(),
            "lists": [p.to_dict() for p in self.lists],
            "block_map": self.block_maps(),
            "legend": LEGEND,
            "marks": {mark.char: mark.style() for mark in BLOCK_MARKS},
            "stream_map": self.stream_maps(),
            "stream_legend": STREAM_LEGEND,
            "stream_marks": {mark.char: mark.style() for mark in STREAM_MARKS},
            "streamed_blocks": self.streamed_blocks,
            "notes": list(self.notes),
        }


def unused_keys(schedule: CheckpointSchedule) -> list[str]:
    """Notes for the keys that do nothing because ``schedule`` checkpoints no block
    (``gradient_checkpointing=False``, the planner's ``none``): a backend other than the default
    (``unsloth``'s offload acts on checkpointed regions' inputs), an interval, a stride. An
    Activation Offload Options node's backend over such a schedule is one (the node says so)."""
    if schedule.gradient_checkpointing:
        return []
    unused = [f"{key}={value}" for key, value in (
        ("gradient_checkpointing_backend", None if schedule.backend == DEFAULT_BACKEND
         else schedule.gradient_checkpointing_backend),
        ("gradient_checkpointing_interval", schedule.gradient_checkpointing_interval),
        ("gradient_checkpointing_segment_stride", schedule.gradient_checkpointing_segment_stride)) if value is not None]
    if not unused:
        return []
    return [f"gradient_checkpointing=False: {' and '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing "
            "(no block is checkpointed, so no checkpointed region's inputs are offloaded or recomputed)"]


def effective_plan(family: FamilyAdapter, schedule: CheckpointSchedule,
                   num_blocks: Mapping[str, int], warn: bool = True, fsdp_checkpointing: bool = False,
                   host_device: bool = False) -> ModelPlan:
    """The plan the engine will actually apply to a model of ``family``.

    Args:
        family: the family adapter.
        schedule: the requested schedule.
        num_blocks: number of blocks of each of the family's block lists, by list name.
        warn: emit a :class:`ScheduleWarning` for every key that is ignored.
        fsdp_checkpointing: FSDP-style activation checkpointing applies instead
            (:func:`fsdp_plan`).
        host_device: the model trains on a device that is host memory (the CPU: no CUDA); a
            streaming plan then notes :data:`HOST_STREAMING_NOTE` (not warned: it changes no key).

    Returns:
        The :class:`ModelPlan`; every ignored key is named in its notes, and its schedule's
        ``weight_offload_blocks`` is the number of blocks that stream when more were asked for.

    Raises:
        KeyError: ``num_blocks`` lacks one of the family's lists.
        ScheduleError: see :func:`check_supported`.
    """
    if fsdp_checkpointing:
        return fsdp_plan(family, schedule, num_blocks, warn)
    check_supported(family, schedule)
    interval, stride, notes = _segments(family, schedule)
    plan_notes = tuple(family.plan_notes)
    notes += unused_keys(schedule)
    lists = []
    for block_list in family.block_lists:
        list_notes: tuple[str, ...] = ()
        if schedule.gradient_checkpointing and not block_list.routed:
            list_notes = ("the model's loop calls these blocks directly: never checkpointed",)
        lists.append(plan_block_list(block_list.name, num_blocks[block_list.name], interval, stride,
                                     schedule.gradient_checkpointing, list_notes, block_list.routed))
    if (schedule.gradient_checkpointing_offload_attention and schedule.gradient_checkpointing
            and not schedule.backend.ffn_scope):
        notes.append("gradient_checkpointing_offload_attention acts on blocks outside whole-block "
                     "checkpoint regions (the plain ones); inside a region the attention activations "
                     "are not kept at all, so there is nothing to offload")
    lists, stream_notes = choose_streamed(lists, schedule)
    notes += stream_notes
    streamed = sum(len(lp.streamed) for lp in lists)
    if schedule.weight_offload_blocks is not None and schedule.weight_offload_blocks > streamed:
        schedule = schedule.replace(weight_offload_blocks=streamed or None)  # the mode names how many stream
    if warn:
        for note in notes:
            warnings.warn(note, ScheduleWarning, stacklevel=2)
    if host_device and streamed:
        notes.append(HOST_STREAMING_NOTE)
    return ModelPlan(family.name, schedule, tuple(lists), plan_notes + tuple(notes))


def _segments(family: FamilyAdapter, schedule: CheckpointSchedule) -> tuple[int, int | None, list[str]]:
    """The interval and stride ``family`` applies of ``schedule``'s, and a note for each it ignores
    (a family without a segmented whole-block path checkpoints every block on its own)."""
    interval, stride = schedule.interval, schedule.gradient_checkpointing_segment_stride
    if schedule.gradient_checkpointing and not family.segmented and (interval > 1 or stride):
        return 1, None, [f"{family.name} has no segmented whole-block path: gradient_checkpointing_interval="
                         f"{schedule.gradient_checkpointing_interval} and gradient_checkpointing_segment_stride="
                         f"{stride} are ignored; every block is checkpointed on its own"]
    if schedule.gradient_checkpointing and stride and not family.stride_honoured:
        return interval, None, [f"{family.name} does not honour gradient_checkpointing_segment_stride={stride}: "
                                "ignored, every block is checkpointed in segments of the interval"]
    return interval, stride, []


HOST_STREAMING_NOTE = ("weight_offload=stream saves no memory on the CPU: the device is host memory, so the streamed "
                       "weights stay where they were and only gain copies (the step peaks leave their host copies out "
                       "and read lower than the memory used); on a CUDA device they leave the device")
"""The plan's note when a streaming run's device is the host (said once per run: the plan is
rendered once in the log and written once to ``report.json``)."""


def choose_streamed(lists: list["ListPlan"], schedule: CheckpointSchedule) -> tuple[list["ListPlan"], list[str]]:
    """The blocks whose frozen weights stream (``weight_offload=stream``), marked in each list.

    Every routed block streams by default; with ``weight_offload_blocks`` = N below that, the N
    streamed blocks are spread evenly over the model's blocks in forward order (block
    ``floor((k + 1/2) * total / N)`` for k = 0..N-1), so that each copy can run while a resident
    block computes. Blocks of a list the model's loop calls directly are never seen by the runner
    and stay resident (noted).

    Returns:
        ``(lists with ListPlan.streamed set, notes)``.
    """
    if not schedule.streams:
        return lists, []
    routed = [(li, bi) for li, lp in enumerate(lists) if lp.routed for bi in range(lp.num_blocks)]
    notes = []
    want = schedule.weight_offload_blocks
    if want is None or want >= len(routed):
        if want is not None and want > len(routed):
            notes.append(f"weight_offload_blocks={want} is more than the {len(routed)} blocks the runner sees: "
                         f"all {len(routed)} stream")
        chosen = set(routed)
    else:
        chosen = {routed[int((k + 0.5) * len(routed) / want)] for k in range(want)}
    if any(not lp.routed for lp in lists):
        notes.append("weight_offload=stream: block lists the model's loop calls directly ("
                     + ", ".join(lp.name for lp in lists if not lp.routed) + ") keep their weights on the device")
    out = [replace(lp, streamed=tuple(bi for bi in range(lp.num_blocks) if (li, bi) in chosen))
           for li, lp in enumerate(lists)]
    return out, notes


def fsdp_plan(family: FamilyAdapter, schedule: CheckpointSchedule, num_blocks: Mapping[str, int],
              warn: bool = True) -> ModelPlan:
    """The plan of FSDP-style activation checkpointing: ``checkpoint_wrapper`` around every block
    of every list (each block its own checkpoint, recomputed once in backward).

    The documents' rule (docs/SCHEDULES.md "Family rules": when FSDP activation checkpointing is
    on, model-level checkpointing is disabled to avoid applying both): the requested model-level
    schedule is switched off; when it asked for checkpointing, a :class:`ScheduleWarning` says so
    and the plan's notes keep it.
    """
    notes = []
    if schedule.gradient_checkpointing:
        notes.append(f"fsdp_activation_checkpointing=True: FSDP-style per-block activation checkpointing "
                     f"(checkpoint_wrapper on every block) applies, so the model-level schedule ({schedule.mode}, "
                     f"backend {schedule.backend.name}) is switched off rather than applied as well")
        if warn:
            warnings.warn(notes[0], ScheduleWarning, stacklevel=3)
    lists = tuple(plan_block_list(bl.name, num_blocks[bl.name], 1, None, True, (), True) for bl in family.block_lists)
    return ModelPlan(family.name, CheckpointSchedule(), lists, tuple(notes), FSDP_WRAPPER)


def count_blocks(family: FamilyAdapter, model: Any) -> dict[str, int]:
    """Number of blocks in each of ``family``'s lists of ``model``."""
    return {bl.name: len(family.blocks(model, bl)) for bl in family.block_lists}


@dataclass(frozen=True)
class ListPlan:
    """The effective plan of one block list.

    Attributes:
        name: the block list's short name (e.g. ``double``).
        num_blocks: number of blocks n in the list.
        segments: checkpointed segments as half-open ``(start, end)`` block index ranges; each is
            ONE checkpoint call. Empty when nothing is checkpointed.
        notes: why the plan differs from what the schedule asked, if it does.
        routed: ``False`` for a list the model's loop calls directly, never through the
            checkpoint function: no schedule or offload option can act on it.
        streamed: indices of blocks whose frozen weights stream from host memory.
    """

    name: str
    num_blocks: int
    segments: tuple[tuple[int, int], ...]
    notes: tuple[str, ...] = field(default=())
    routed: bool = True
    streamed: tuple[int, ...] = ()

    @property
    def checkpointed(self) -> tuple[int, ...]:
        """Indices of checkpointed blocks (each recomputed once in backward)."""
        return tuple(i for start, end in self.segments for i in range(start, end))

    @property
    def plain(self) -> tuple[int, ...]:
        """Indices of blocks that run normally (activations kept)."""
        done = set(self.checkpointed)
        return tuple(i for i in range(self.num_blocks) if i not in done)

    def block_map(self, mark: str = "C", plain_mark: str = ".") -> str:
        """One character per block: ``mark`` for checkpointed blocks, ``plain_mark`` for the others."""
        done = set(self.checkpointed)
        return "".join(mark if i in done else plain_mark for i in range(self.num_blocks))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, including checkpointed/plain indices."""
        return {
            "name": self.name,
            "num_blocks": self.num_blocks,
            "segments": [list(s) for s in self.segments],
            "checkpointed": list(self.checkpointed),
            "plain": list(self.plain),
            "routed": self.routed,
            "streamed": list(self.streamed),
            "notes": list(self.notes),
        }


def plan_block_list(name: str, num_blocks: int, interval: int, stride: int | None = None,
                    enabled: bool = True, notes: tuple[str, ...] = (), routed: bool = True) -> ListPlan:
    """Pure function: the checkpointed segments of a list of ``num_blocks`` blocks.

    With interval N and stride S (S defaults to N) the segments are ``[k*S, min(k*S+N, n))`` for
    k = 0, 1, ... while ``k*S < n`` (docs/SCHEDULES.md "Semantics"). A tail shorter than N is a
    shorter last segment; no block is ever dropped. N = 1 gives exactly per-block checkpointing.

    Args:
        name: the list's short name, carried into the plan.
        num_blocks: n >= 0.
        interval: N >= 1.
        stride: S >= N, or ``None`` for S = N.
        enabled: ``False`` gives an empty plan (every block plain).
        notes: free-text notes carried into the plan.
        routed: see :attr:`ListPlan.routed` (an unrouted list gets an empty plan).

    Raises:
        ScheduleError: N < 1 or S < N.
    """
    stride = interval if stride is None else stride
    if interval < 1:
        raise ScheduleError(f"gradient_checkpointing_interval={interval!r} is invalid: allowed an integer >= 1.")
    if stride < interval:
        raise ScheduleError(f"gradient_checkpointing_segment_stride={stride!r} is invalid: allowed an integer >= {interval}.")
    segments: tuple[tuple[int, int], ...] = ()
    if enabled and routed:
        segments = tuple((s, min(s + interval, num_blocks)) for s in range(0, num_blocks, stride))
    return ListPlan(name=name, num_blocks=num_blocks, segments=segments, notes=tuple(notes), routed=routed)
