"""The planner's cost model: what a schedule adds to the plain step, block by block, and what it
costs on this machine.

:class:`BlockCost` is what the probe (:mod:`.probe`) measures of one block; :class:`Walk` passes
over the blocks of every list in forward order under one schedule's effective plan and adds up
what each keeps until backward and the worst moment of forward, recompute and backward (bytes),
and the work the schedule adds (:class:`Work`): recomputed forward seconds, checkpoint calls and
the tensors their hooks see, offloaded tensors and bytes, and the tensors a streamed plain block's
hook sees. :func:`~.planner.predict` prices the work at a :class:`Calibration`'s rates.

At the sizes where a schedule matters on the CPU, bookkeeping that does not scale with the
arithmetic is a large share of that cost: a checkpoint call's own cost,
``torch.utils.checkpoint``'s hook calls per tensor a recomputed region saves, an offloaded
tensor's pack, copy and unpack, a streamed plain block's hook per tensor it saves (its weight
copies are priced per byte). :func:`calibrate` measures those rates once: short runs of the plain
step, every block checkpointed (``layer``), every FFN checkpointed (``layer-torch-ffn``: the
per-call and per-tensor rates are solved from the two), attention offload and, when the config
streams weights, every block streamed, timed in lockstep (:mod:`.lockstep`: one step of each in
turn, so a shared machine's drift cancels); each rate is a run's median extra seconds over the
plain one, less what the other terms explain, divided by what it adds (docs/MEASURE.md "How the
planner predicts").
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..config.backends import TABLE
from ..config.schedule import CheckpointSchedule
from ..core.plan import effective_plan
from ..families import get_family
from ..train.loop import TrainingRun
from .lockstep import lockstep_runs, paired_difference, step_seconds
from .runs import RunWorkspace


@dataclass
class BlockCost:
    """Measured cost of one block (bytes, seconds; tensors are counts per step); the memory fields
    are described in :mod:`.planner`. ``saved_tensors`` / ``ffn_tensors``: the tensors the block
    (its FFN) saves for backward, each one a call of a checkpoint's or the streamer's saved-tensor
    hook; ``attn_tensors`` / ``attn_copied``: the tensors and bytes attention offload copies."""

    list_name: str
    index: int
    act: int = 0
    carried: int = 0
    ffn: int = 0
    ffn_in: int = 0
    attn: int = 0
    fwd_s: float = 0.0
    ffn_s: float = 0.0
    fwd_peak: int = 0
    grad: int = 0
    ffn_in_attn: int = 0
    attn_tensors: int = 0
    attn_copied: int = 0
    saved_tensors: int = 0
    ffn_tensors: int = 0


@dataclass
class Work:
    """What a schedule adds to the plain step per step (seconds, counts, bytes).

    Attributes:
        recompute_s: forward seconds recomputed in backward. calls: checkpoint calls.
        recompute_tensors: tensors the recomputed regions save (hook calls, both passes).
        offload_tensors / offload_bytes: what the offloader copies to host memory.
        stream_tensors: tensors saved by streamed blocks that run plainly (the streamer's hook).
    """

    recompute_s: float = 0.0
    calls: int = 0
    recompute_tensors: int = 0
    offload_tensors: int = 0
    offload_bytes: int = 0
    stream_tensors: int = 0


class Walk:
    """One pass over ``blocks`` (per list, in forward order) under ``schedule``: call
    :meth:`block_list` per list of the effective plan; then :attr:`worst`, :attr:`forward_worst`,
    :attr:`kept_before` (bytes), :attr:`kept_on_host` (bytes waiting in host memory) and
    :attr:`work` hold the result."""

    def __init__(self, blocks: dict[str, list[BlockCost]], schedule):
        backend = schedule.backend if schedule.gradient_checkpointing else None
        self.ffn_scope = bool(backend and backend.ffn_scope)
        self.offload_inputs = bool(backend and backend.offload_inputs)
        self.offload_attn = schedule.gradient_checkpointing_offload_attention
        self.blocks = blocks
        self.plan = None  # the effective plan walked (:func:`work`)
        self.kept_before = self.worst = self.forward_worst = self.kept_on_host = 0
        self.work = Work()
        # backward runs last block first: when block b's backward runs, the gradients of every
        # later block already exist (they stay until the optimizer step)
        self.grads_after, total, running = {}, sum(c.grad for cs in blocks.values() for c in cs), 0
        for name, costs in blocks.items():
            for c in costs:
                running += c.grad
                self.grads_after[(name, c.index)] = total - running

    def block_list(self, list_plan, block_list) -> None:
        """Add one list (``list_plan`` of :class:`~..core.plan.ModelPlan`, its family ``block_list``)."""
        costs = self.blocks[list_plan.name]
        starts, checkpointed, streamed = dict(list_plan.segments), set(list_plan.checkpointed), set(list_plan.streamed)
        i = 0
        while i < len(costs):
            if not self.ffn_scope and i in starts:  # whole-block segment [i, end): recomputed as one
                self.segment(list_plan.name, costs[i:starts[i]], len(block_list.carry.links))
                i = starts[i]
                continue
            attention = bool(self.offload_attn and block_list.attention and block_list.routed)
            ffn = self.ffn_scope and i in checkpointed and bool(block_list.ffn)
            self.block(list_plan.name, costs[i], attention, ffn)
            if i in streamed:  # runs plainly: the streamer's hook sees what it saves outside its FFN
                self.work.stream_tensors += costs[i].saved_tensors - (costs[i].ffn_tensors if ffn else 0)
            i += 1

    def _offload(self, tensors: int, copied: int, kept: int) -> None:
        self.work.offload_tensors += tensors
        self.work.offload_bytes += copied
        self.kept_on_host += kept

    def segment(self, name: str, segment: list[BlockCost], links: int) -> None:
        """A whole-block checkpoint segment (recomputed as one; ``links``: its carried inputs)."""
        first, last = segment[0], segment[-1]
        if self.offload_inputs:
            self._offload(links, first.carried, first.carried)
        # backward of the segment: all its activations; its recompute: the last block's forward
        # transient on top of the others' activations (no gradients alive yet)
        self.worst = max(self.worst, self.kept_before + sum(c.act for c in segment) + self.grads_after[(name, last.index)])
        self.forward_worst = max(self.forward_worst, self.kept_before + sum(c.act for c in segment[:-1]) + last.fwd_peak)
        self.work.recompute_s += sum(c.fwd_s for c in segment)
        self.work.calls += 1
        self.work.recompute_tensors += sum(c.saved_tensors for c in segment)
        self.kept_before += 0 if self.offload_inputs else first.carried

    def block(self, name: str, cost: BlockCost, attention: bool, ffn: bool) -> None:
        """A block that runs plainly (``ffn``: its FFN checkpointed; ``attention``: offloaded)."""
        attn_off = cost.attn if attention else 0
        keep = cost.act - attn_off
        if ffn:
            keep = cost.act - cost.ffn + (0 if self.offload_inputs else cost.ffn_in) - attn_off
            if attn_off and not self.offload_inputs:
                keep += cost.ffn_in_attn
            if self.offload_inputs:
                self._offload(1, cost.ffn_in, cost.ffn_in)
            self.work.recompute_s += cost.ffn_s
            self.work.calls += 1
            self.work.recompute_tensors += cost.ffn_tensors
        if attention:
            self._offload(cost.attn_tensors, cost.attn_copied, attn_off)
        # offloaded attention activations come back late in the block's backward, after the
        # FFN's and the block's other transients are freed: they do not raise its peak
        self.worst = max(self.worst, self.kept_before + cost.act - attn_off + self.grads_after[(name, cost.index)])
        self.kept_before += keep


def work(family, blocks: dict[str, list[BlockCost]], schedule) -> Walk:
    """The finished :class:`Walk` of ``schedule`` over ``blocks`` (its family's effective plan).

    Raises:
        ScheduleError: the family cannot run ``schedule``.
    """
    counts = {name: len(costs) for name, costs in blocks.items()}
    plan = effective_plan(family, schedule, counts, warn=False)
    walk = Walk(blocks, schedule)
    for list_plan, block_list in zip(plan.lists, family.block_lists):
        walk.block_list(list_plan, block_list)
    walk.plan = plan
    return walk


CALIBRATION_STEPS = 5
"""Measured steps of each calibration run after its warm-up."""
PLAIN = CheckpointSchedule(gradient_checkpointing=False)
"""The reference run of the calibration (and the probe's own schedule)."""


@dataclass(frozen=True)
class Calibration:
    """Costs of the engine's machinery, seconds (0 where nothing was measured).

    Attributes:
        offload_s_per_tensor / offload_s_per_byte: one tensor kept in host memory by the offloader
            (pack, device-to-host copy, unpack, copy back); the byte rate is a measured memcpy.
        recompute_s_per_call / recompute_s_per_tensor: a checkpoint call's own bookkeeping, and
            its hooks' per tensor the region saves (on top of the region's forward seconds, which
            the recompute spends again).
        stream_s_per_tensor: the streamer's pack hook per tensor a streamed plain block saves (the
            weight copies are counted apart, per byte).
        plain_seconds: the step seconds of the calibration's plain run after its warm-up (more
            samples of the plain sec/step for the probe that ran it; empty when carried to another).
    """

    offload_s_per_tensor: float = 0.0
    offload_s_per_byte: float = 0.0
    recompute_s_per_call: float = 0.0
    recompute_s_per_tensor: float = 0.0
    stream_s_per_tensor: float = 0.0
    plain_seconds: tuple[float, ...] = ()


def seconds(calibration: Calibration, added: Work) -> float:
    """Seconds ``added`` costs on top of the plain step at ``calibration``'s rates (weight copies apart)."""
    return (added.recompute_s + added.calls * calibration.recompute_s_per_call
            + added.recompute_tensors * calibration.recompute_s_per_tensor
            + added.offload_tensors * calibration.offload_s_per_tensor
            + added.offload_bytes * calibration.offload_s_per_byte
            + added.stream_tensors * calibration.stream_s_per_tensor)


CALIBRATION_RUNS = 4
"""The runs :func:`calibrate` trains without streaming (plain, layer, FFN, attention offload): what
a caller announces before probing; the probe corrects it by the runs it adds (streaming) or leaves
out (no FFN sub-blocks, no attention to offload)."""


def calibration_steps(warmup_steps: int, runs: int = CALIBRATION_RUNS) -> int:
    """Steps of ``runs`` calibration runs."""
    return runs * (warmup_steps + CALIBRATION_STEPS)


def calibration_schedules(family, blocks: dict[str, list[BlockCost]], stream: bool) -> list[CheckpointSchedule]:
    """The runs of :func:`calibrate` after the plain one: ``layer``, and where they add work,
    ``layer-torch-ffn`` (a family with FFN sub-blocks), attention offload, every block streamed
    (``stream``: the config streams weights)."""
    ffn = next(b for b in TABLE.values() if b.ffn_scope and not b.offload_inputs)  # torch-ffn
    candidates = [CheckpointSchedule(), CheckpointSchedule(gradient_checkpointing_backend=ffn.name),
                  PLAIN.replace(gradient_checkpointing_offload_attention=True)]
    if stream:
        candidates.append(PLAIN.replace(weight_offload="stream"))
    useful = []
    for schedule in candidates:
        added = work(family, blocks, schedule).work
        if added.calls or added.offload_tensors or added.stream_tensors:
            useful.append(schedule)
    return useful


def calibrate(workspace: RunWorkspace, warmup_steps: int, schedules: list[CheckpointSchedule],
              blocks: dict[str, list[BlockCost]], frozen_bytes: int, h2d_s_per_byte: float) -> Calibration:
    """Measure the :class:`Calibration` of this machine (see the module docstring).

    Args:
        workspace: the probe's, open (its settings and model; each run trains its own copy of the model).
        warmup_steps: unpaired leading steps of each run.
        schedules: the runs besides the plain one (:func:`calibration_schedules`).
        blocks: the probe's block costs (what each run adds, :func:`~.costs.work`).
        frozen_bytes: every block's frozen bytes (the streaming run copies each twice).
        h2d_s_per_byte: seconds per byte of one weight copy.

    Raises:
        Exception: the first error of a calibration run (as :func:`~.lockstep.lockstep_runs`).
    """
    family = get_family(workspace.bundle.family.name)
    results = lockstep_runs(workspace, [PLAIN, *schedules], warmup_steps, CALIBRATION_STEPS)
    plain, extra = results[0], {}
    for schedule, result in zip(schedules, results[1:]):
        extra[schedule.mode] = (max(0.0, paired_difference(result, plain, warmup_steps)),
                                work(family, blocks, schedule).work)
    per_byte = copy_seconds_per_byte(torch.device(plain.report["environment"]["device"]))
    by_scope = {s.backend.ffn_scope: extra[s.mode] for s in schedules if s.gradient_checkpointing}
    per_call, per_tensor = _recompute_rates(by_scope.get(False), by_scope.get(True))
    offload, stream = extra.get("none-offload-attn"), extra.get("none-stream")
    return Calibration(
        offload_s_per_tensor=_rate(offload[0] - per_byte * offload[1].offload_bytes, offload[1].offload_tensors)
        if offload else 0.0,
        offload_s_per_byte=per_byte, recompute_s_per_call=per_call, recompute_s_per_tensor=per_tensor,
        stream_s_per_tensor=_rate(stream[0] - 2 * frozen_bytes * h2d_s_per_byte, stream[1].stream_tensors)
        if stream else 0.0, plain_seconds=tuple(step_seconds(plain, warmup_steps)))


CALIBRATIONS_KEPT = 8
"""Calibrations one process remembers (the most recent; :func:`remembered_calibration`)."""
_REMEMBERED: dict[tuple, Calibration] = {}


def calibration_key(workspace: RunWorkspace, warmup_steps: int) -> tuple | None:
    """What a calibration depends on: the model (class and config), its settings (device,
    precisions, attention kernels, compile), the adapter, whether the config streams weights, the
    warm-up and the threads; ``None`` where a run is not the trainer's own (a test's stand-in),
    which is never remembered. The batch shape is left out: the rates are per call, tensor and
    byte, which is why one probe's calibration already serves every bucket of a run."""
    if workspace.start_run is not TrainingRun:
        return None
    model, config = workspace.bundle.transformer, workspace.config
    first = next(model.parameters(), None)
    return (type(model).__qualname__, repr(dict(getattr(model, "config", {}))), repr(config.model),
            repr(config.lora), config.schedule.streams, warmup_steps, torch.get_num_threads(),
            None if first is None else str(first.dtype))


def remembered_calibration(key: tuple | None) -> Calibration | None:
    """The calibration this process measured last under ``key`` (:func:`calibration_key`), or None.

    A ComfyUI server plans and pre-flights the same model many times (the Schedule Planner node,
    then Train LoRA's pre-flight, then every queue again): the machine's rates are measured once
    per model and settings, the plain step's seconds on every probe."""
    return None if key is None else _REMEMBERED.get(key)


def remember_calibration(key: tuple | None, calibration: Calibration) -> None:
    """Keep ``calibration`` under ``key`` (its plain step's seconds left out: they belong to the
    probe's shape), the :data:`CALIBRATIONS_KEPT` most recent."""
    if key is None:
        return
    _REMEMBERED.pop(key, None)
    _REMEMBERED[key] = dataclasses.replace(calibration, plain_seconds=())
    while len(_REMEMBERED) > CALIBRATIONS_KEPT:
        del _REMEMBERED[next(iter(_REMEMBERED))]


def forget_calibrations() -> None:
    """Forget every remembered calibration: the next probe measures its own."""
    _REMEMBERED.clear()


def _rate(extra_s: float, count: int) -> float:
    return max(0.0, extra_s) / count if count else 0.0


def _recompute_rates(layer: tuple[float, Work] | None, ffn: tuple[float, Work] | None) -> tuple[float, float]:
    """(seconds per checkpoint call, seconds per saved tensor) from two runs: every block
    checkpointed (many tensors per call) and every FFN (few): the two equations
    ``extra - recompute_s = calls * per_call + tensors * per_tensor``, solved; without the FFN
    run, or where a solved rate is negative (noise), one rate per tensor."""
    if layer is None:
        return 0.0, 0.0
    extra_a, a = layer
    left_a = max(0.0, extra_a - a.recompute_s)
    if ffn is not None:
        extra_b, b = ffn
        left_b = max(0.0, extra_b - b.recompute_s)
        det = a.calls * b.recompute_tensors - b.calls * a.recompute_tensors
        if det:
            per_call = (left_a * b.recompute_tensors - left_b * a.recompute_tensors) / det
            per_tensor = (a.calls * left_b - b.calls * left_a) / det
            if per_call >= 0 and per_tensor >= 0:
                return per_call, per_tensor
    return 0.0, _rate(left_a, a.recompute_tensors)


def copy_seconds_per_byte(device: torch.device) -> float:
    """Seconds per byte of one device -> host -> device round trip (16 MiB, best of 3)."""
    source = torch.empty(4 << 20, dtype=torch.float32, device=device)
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        source.copy_(target)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best / source.nbytes
