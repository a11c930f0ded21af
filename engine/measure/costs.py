"""What a schedule adds to the plain step, block by block: the planner's cost model.

:class:`BlockCost` is what the probe (:mod:`.probe`) measures of one block; :class:`Walk` passes
over the blocks of every list in forward order under one schedule's effective plan and adds up
what each keeps until backward and the worst moment of forward, recompute and backward (bytes,
docs/MEASURE.md "How the planner predicts"), and the work the schedule adds (:class:`Work`):
recomputed forward seconds, checkpoint calls and the tensors their hooks see, offloaded tensors
and bytes, and the tensors a streamed plain block's hook sees. :func:`~.planner.predict` prices
the work with the probe's :class:`~.calibration.Calibration`; :func:`~.calibration.calibrate`
measures that calibration from the same work terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.plan import effective_plan


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
