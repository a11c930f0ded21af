"""The segment runner: one executor of checkpoint plans for every family.

diffusers models call ``self._gradient_checkpointing_func(block, *args)`` for each block when
gradient checkpointing is enabled (docs/SCHEDULES.md "How the engine hooks into diffusers"). A
:class:`SegmentRunner` is installed as that function on our training copy of the model. When the
loop calls the first block of a planned segment ``[s, e)``, the runner runs blocks ``s..e-1``
inside ONE non-reentrant :func:`torch.utils.checkpoint.checkpoint` call, feeding each block's
outputs to the next through the list's carry map, and answers the loop's calls for blocks
``s+1..e-1`` by passing the group's result through. Blocks outside every segment run plainly.

Safety net: before passing a result through, the runner checks that the loop called the next
block of the list with exactly the arguments the carry map predicts (carried tensors by identity,
everything else unchanged) and that it changed none of the segment's output tensors in place (their
version counters). If the loop changed state between two blocks (a ControlNet residual,
a per-block modulation slice, ...), the values already returned are wrong, so the runner aborts
that forward pass, switches the list to per-block checkpointing with a warning naming the family
and the list, restores the RNG state and runs the forward again (see :meth:`SegmentRunner.forward`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from ..families.base import BlockList, Carry, FamilyAdapter
from .arguments import _snapshot, _tensors, same_arguments  # noqa: F401 (same_arguments re-exported)
from .attention_saving import AttentionSaving
from .offload import HostPool, Offloader, Saved, resident_storages
from .plan import RUNNER, ModelPlan, ScheduleWarning
from .streaming import WeightStreamer, frozen_device_bytes


class CarryMismatch(RuntimeError):
    """The model's loop did not feed a segment's blocks as the carry map predicts.

    Attributes:
        list_name: the block list whose segment is invalid.
        reason: what differed.
    """

    def __init__(self, list_name: str, reason: str):
        super().__init__(f"{list_name}: {reason}")
        self.list_name = list_name
        self.reason = reason


@dataclass
class RunnerStats:
    """Counters of one runner, reset per step by the trainer.

    Attributes:
        checkpoint_calls: checkpoint calls made in forward (one per segment, or per FFN region).
        recomputed_blocks: whole blocks entered again during backward recompute.
        recomputed_ffn: FFN sub-blocks recomputed (``*-ffn`` backends).
        plain_blocks: blocks run without checkpointing.
        undeclared_calls: checkpoint calls for modules outside the family's declared lists
            (checkpointed per call, as diffusers does; a correct adapter declares them all).
        fallbacks: lists switched to per-block, with the reason.
    """

    checkpoint_calls: int = 0
    recomputed_blocks: int = 0
    recomputed_ffn: int = 0
    plain_blocks: int = 0
    undeclared_calls: int = 0
    fallbacks: list[str] = field(default_factory=list)

    def reset(self) -> None:
        """Zero the per-step counters (fallbacks are kept: they hold for the whole run)."""
        self.checkpoint_calls = self.recomputed_blocks = self.recomputed_ffn = self.plain_blocks = 0
        self.undeclared_calls = 0


@dataclass
class _Pending:
    list_index: int
    next_block: int
    end: int
    output: Any
    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """The segment's output tensors and their version counters when it returned: the loop may not
    change them in place before it calls the segment's next block."""


_NULL = contextlib.nullcontext()
"""A reusable do-nothing context (no allocation per block call)."""


class RecomputeMismatch(RuntimeError):
    """A checkpointed region's recompute in backward did not repeat its forward.

    Attributes:
        list_name, blocks: the block list and the blocks ``[start, end)`` of the region.
        block: the last block the recompute entered. ffn: the region was that block's FFN only.
    """

    def __init__(self, list_name: str, blocks: tuple[int, int], block: int, ffn: bool, reason: str):
        super().__init__(reason)
        self.list_name, self.blocks, self.block, self.ffn = list_name, blocks, block, ffn


class _Region:
    """The function one checkpoint call runs: blocks of one segment, chained by the carry map."""

    __slots__ = ("runner", "blocks", "carry", "runs", "list_name", "start", "attends")

    def __init__(self, runner: "SegmentRunner", blocks: list[torch.nn.Module], carry: Carry, list_name: str,
                 start: int, attends: bool = True):
        self.runner, self.blocks, self.carry, self.runs = runner, blocks, carry, 0
        self.list_name, self.start = list_name, start
        self.attends = attends
        """The list's blocks hold attention (``BlockList.attention``): a region saving none is counted."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        recompute = self.runs > 1
        saving = self.runner.saving if self.attends else None
        with self.runner._in_region(recompute), (saving.region() if saving and not recompute else _NULL):
            output = None
            for i, block in enumerate(self.blocks):
                if recompute:
                    self.runner.stats.recomputed_blocks += 1
                    self.runner.last_recompute = (self.list_name, (self.start, self.start + len(self.blocks)),
                                                  self.start + i, False)
                output = block(*args, **kwargs)
                if i + 1 < len(self.blocks):
                    args, kwargs = self.carry.apply(output, args, kwargs)
            return output


class _FfnRegion:
    """The function an FFN-only checkpoint call runs: the block's original FFN forward(s)."""

    def __init__(self, runner: "SegmentRunner", forwards: list[Callable[..., Any]], where: tuple[str, int],
                 list_index: int):
        self.runner, self.forwards, self.runs = runner, forwards, 0
        self.list_name, self.block = where
        self.list_index = list_index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        recompute = self.runs > 1
        with self.runner._in_region(recompute):
            if recompute:
                self.runner._stream_in(self.list_index, self.block)  # the block's own pre-hook does not run
                self.runner.stats.recomputed_ffn += 1
                self.runner.last_recompute = (self.list_name, (self.block, self.block + 1), self.block, True)
            output = self.forwards[0](*args, **kwargs)
            for forward in self.forwards[1:]:
                output = forward(output)
            return output


@contextlib.contextmanager
def _swap_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Replace ``module.forward`` on this instance for the ``with`` block, then undo it."""
    had, old = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = old
        else:
            del module.forward


class SegmentRunner:
    """Executes a :class:`~.plan.ModelPlan` on a diffusers model through its checkpoint hook.

    Use :meth:`install` once, then call :meth:`forward` instead of ``model(...)`` so that a carry
    mismatch can fall back and retry; call :meth:`close` at the end of the run (it drops the host
    pool). Attributes of interest: :attr:`plan` (updated on fallback), :attr:`stats`, and
    :attr:`offloader` (``None`` unless the schedule offloads).

    Backends (docs/SCHEDULES.md "Backends"): ``torch`` runs each segment in one checkpoint call;
    ``unsloth`` does the same with the segment's carried boundary inputs (the hidden states it
    keeps for its recompute) offloaded to host memory; ``torch-ffn`` / ``unsloth-ffn`` run the
    planned blocks plainly but checkpoint each one's FFN sub-block on its own (an FFN-only region
    cannot span blocks, since attention runs between them), offloading the FFN input for
    ``unsloth-ffn``. With ``gradient_checkpointing_offload_attention`` every block that is not
    inside a whole-block region runs its attention sub-block with its saved activations offloaded.
    With ``weight_offload=stream`` the plan's streamed blocks keep their frozen weights in host
    memory and :attr:`streamer` (:class:`~.streaming.WeightStreamer`) brings each segment or plain
    block in before it runs, is recomputed or runs backward.

    Args:
        model: a diffusers model of ``family`` (our training copy: installing changes its
            gradient-checkpointing function; sub-module forwards are swapped only for the
            duration of one block call).
        family: the family adapter.
        plan: the plan from :func:`~.plan.effective_plan`.
        checkpoint_fn: the checkpoint implementation, ``checkpoint(fn, *args, **kwargs)``;
            defaults to non-reentrant :func:`torch.utils.checkpoint.checkpoint` with RNG state
            preserved (so dropout recomputes identically).
        device: where streamed weights are used (default: that of the model's trainable
            parameters, else of its first parameter).
        strict_streaming: see :class:`~.streaming.WeightStreamer` (tests).
    """

    def __init__(self, model: torch.nn.Module, family: FamilyAdapter, plan: ModelPlan,
                 checkpoint_fn: Callable[..., Any] | None = None, device: torch.device | None = None,
                 strict_streaming: bool = False):
        self.model, self.family, self.plan = model, family, plan
        self.entry: Callable[..., Any] = model
        """What :meth:`forward` calls: the model, or its ``DistributedDataParallel`` wrapper
        (``engine/model/distributed.py`` ``replicate``: DDP's reducer needs its forward)."""
        self.stats = RunnerStats()
        self._checkpoint = checkpoint_fn or functools.partial(
            checkpoint, use_reentrant=False, preserve_rng_state=True)
        # plain lists: slicing an nn.ModuleList builds a new module on every call
        self._lists = [list(family.blocks(model, bl)) for bl in family.block_lists]
        self._where = {id(b): (li, bi) for li, blocks in enumerate(self._lists) for bi, b in enumerate(blocks)}
        self._segment_end: list[dict[int, int]] = []
        self._pending: _Pending | None = None
        self._region_depth = 0
        self._recompute_depth = 0
        self.last_recompute: tuple[str, tuple[int, int], int, bool] | None = None
        """(list, region blocks [start, end), last block entered, FFN only) of the latest recompute."""
        schedule = plan.schedule
        self.backend = schedule.backend if schedule.gradient_checkpointing else None
        self.ffn_scope = bool(self.backend and self.backend.ffn_scope)
        self.offload_inputs = bool(self.backend and self.backend.offload_inputs)
        self.offload_attention = schedule.gradient_checkpointing_offload_attention
        self.offloader: Offloader | None = None
        self.pool: HostPool | None = None
        if self.offload_inputs or self.offload_attention or schedule.streams:
            self.pool = HostPool(schedule.gradient_checkpointing_offload_pin_memory_max_buckets)
        if self.offload_inputs or self.offload_attention:
            self.offloader = Offloader(self.pool, lambda: self.recomputing, resident_storages(model))
        self.saving: AttentionSaving | None = None
        """``gradient_checkpointing_save_attention``: the regions' selective-checkpoint policy and its counts."""
        if schedule.gradient_checkpointing_save_attention and self.backend and not self.ffn_scope:
            off = self.offloader
            self.saving = AttentionSaving(family.attention_ops,
                                          (off.offload, off.unpack, Saved) if self.offload_inputs else None)
            if checkpoint_fn is None:
                self._checkpoint = functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=True,
                                                     context_fn=self.saving)
        params = list(model.parameters())
        self.device = device or next((p.device for p in params if p.requires_grad), params[0].device if params
                                     else torch.device("cpu"))
        self._strict = strict_streaming
        self.streamer: WeightStreamer | None = None
        self._installed = False
        self._index_plan()

    @property
    def recomputing(self) -> bool:
        """True while a checkpointed region is being recomputed in backward."""
        return self._recompute_depth > 0

    @contextlib.contextmanager
    def _in_region(self, recompute: bool) -> Iterator[None]:
        self._region_depth += 1
        self._recompute_depth += recompute
        try:
            yield
        finally:
            self._region_depth -= 1
            self._recompute_depth -= recompute

    def _index_plan(self) -> None:
        self._segment_end = [dict(lp.segments) for lp in self.plan.lists]
        # per block, (list, index, its segment when one starts there: (end, blocks, block list, carry));
        # the *-ffn backends checkpoint inside plain block calls: no segment
        segments = [{start: (end, self._lists[li][start:end], self.family.block_lists[li],
                             self.family.block_lists[li].carry) for start, end in ends.items()}
                    for li, ends in enumerate(self._segment_end)]
        self._entries = {key: (li, bi, None if self.ffn_scope else segments[li].get(bi))
                         for key, (li, bi) in self._where.items()}
        self._ffn_blocks = [set(lp.checkpointed) for lp in self.plan.lists] if self.ffn_scope else None
        self._streamed = [set(lp.streamed) for lp in self.plan.lists]
        if self.streamer is not None:  # a fallback changed the segments: new units
            self.streamer.close()
            self.streamer = None
        if self.plan.streamed_blocks:
            schedule = self.plan.schedule
            stream = self.offloader._stream if self.offloader is not None else None
            self.streamer = WeightStreamer(self._stream_units(), self.pool, self.device,
                                           schedule.weight_offload_prefetch, lambda: self.recomputing, stream,
                                           self._strict)
        if self.offloader is not None:
            self.offloader.weights = self.streamer

    def weight_receipt(self) -> dict[str, int | float]:
        """The step's weight-streaming figures (report.json): ``weight_h2d_bytes``,
        ``weight_copies``, ``weight_d2h_bytes`` (0: frozen weights never go back),
        ``weight_stall_s`` (seconds compute waited on weight copies), ``resident_frozen_bytes``
        (frozen bytes on the device: resident weights and the ring), ``streamed_frozen_bytes``
        (their host copies), ``pinned_host_bytes`` (pinned host memory allocated: weights and activations)
        and the host arena's ``host_arena_bytes`` (chunks allocated), ``host_arena_used_bytes`` (bytes
        of the tensors in them) and ``host_arena_chunks`` (:meth:`~.offload.HostPool.arena_figures`).
        All 0 for a run without a host pool except ``resident_frozen_bytes``."""
        streamer, pool = self.streamer, self.pool
        is_host = pool.is_host if pool is not None else (lambda t: False)
        ring = set(streamer.slot_storages) if streamer is not None else set()
        resident = frozen_device_bytes(self.model, is_host, ring) + (streamer.resident_slot_bytes if streamer else 0)
        stats = streamer.stats if streamer is not None else None
        arena = pool.arena_figures() if pool is not None else {
            "host_arena_bytes": 0, "host_arena_used_bytes": 0, "host_arena_chunks": 0, "pinned_host_bytes": 0}
        return {"weight_h2d_bytes": stats.h2d_bytes if stats else 0, "weight_copies": stats.copies if stats else 0,
                "weight_d2h_bytes": stats.d2h_bytes if stats else 0,
                "weight_stall_s": round(stats.stall_s, 6) if stats else 0.0,
                "resident_frozen_bytes": resident, "streamed_frozen_bytes": streamer.streamed_bytes if streamer else 0,
                **arena}

    def _stream_units(self) -> list[tuple[tuple[tuple[int, int], ...], list[torch.nn.Module]]]:
        """The plan's units (:meth:`~.plan.ModelPlan.stream_units`) with their block modules."""
        return [(unit, [self._lists[li][bi] for li, bi in unit]) for unit in self.plan.stream_units()]

    def _stream_in(self, list_index: int, block_index: int) -> None:
        """Bring a streamed block's unit in for a recompute (backward order)."""
        if self.streamer is not None and block_index in self._streamed[list_index]:
            self.streamer.activate(self.streamer.by_block[(list_index, block_index)], backward=True)

    def install(self) -> "SegmentRunner":
        """Route the model's block calls through this runner (or disable checkpointing when
        nothing is checkpointed or offloaded, or when FSDP's ``checkpoint_wrapper`` applies the plan)."""
        if self.plan.applied_by != RUNNER or (self.plan.checkpointed_blocks == 0 and not self.offload_attention
                                              and self.streamer is None):
            self.model.disable_gradient_checkpointing()
        else:
            self.model.enable_gradient_checkpointing(gradient_checkpointing_func=self)
            self._installed = True
        return self

    def close(self) -> None:
        """Release run-owned resources (the host pool; streamed weights go back to their host
        copies) and route the model's blocks back to diffusers' own checkpoint function: the blocks
        held this runner and the runner the blocks, a reference cycle that kept a finished run's
        model (device weights, pinned host copies) alive until Python's cyclic collector happened to
        run. The runner must not be used afterwards."""
        if self.streamer is not None:
            self.streamer.close()
        self.offloader = self.pool = self.streamer = None
        if self._installed:
            self.model.disable_gradient_checkpointing()
            self._installed = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model; on a :class:`CarryMismatch`, fall back to per-block for that list and retry.

        The RNG state (CPU and CUDA) is restored before the retry, so the retried pass draws the
        same random numbers (dropout) as the aborted one.
        """
        for _ in range(len(self._lists) + 1):
            rng = torch.random.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
            self._pending = None
            try:
                output = self.entry(*args, **kwargs)
                if self._pending is not None:
                    raise CarryMismatch(self.family.block_lists[self._pending.list_index].name,
                                        "the loop stopped inside a segment")
                return output
            except CarryMismatch as exc:
                self._pending = None
                self._fall_back(exc)
                torch.random.set_rng_state(rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
        raise RuntimeError("segment runner: fallback did not converge")  # pragma: no cover

    def _fall_back(self, exc: CarryMismatch) -> None:
        reason = (f"the {self.family.name} loop changes state between blocks of list "
                  f"{exc.list_name!r} ({exc.reason}); fell back to per-block checkpointing")
        warnings.warn(reason, ScheduleWarning, stacklevel=3)
        self.stats.fallbacks.append(reason)
        self.plan = self.plan.with_per_block(exc.list_name, reason)
        self._index_plan()

    def __call__(self, block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The ``gradient_checkpointing_func`` diffusers calls for every block."""
        entry = self._entries.get(id(block))
        if entry is None:  # a module outside the declared lists: checkpoint it as diffusers does
            self.stats.checkpoint_calls += 1
            self.stats.undeclared_calls += 1
            return self._checkpoint(block, *args, **kwargs)
        list_index, block_index, segment = entry
        if self._pending is not None:
            return self._pass_through(list_index, block_index, args, kwargs)
        if segment is None:
            self.stats.plain_blocks += 1
            with self._block_scope(list_index, block_index, block):
                return block(*args, **kwargs)
        end, blocks, block_list, carry = segment
        self.stats.checkpoint_calls += 1
        # the checkpoint keeps these arguments for the recompute: copies of their containers, so
        # that the loop changing a shared dict afterwards changes neither the recompute nor the check
        args, kwargs = _snapshot(args), _snapshot(kwargs)
        region = _Region(self, blocks, carry, block_list.name, block_index, block_list.attention is not None)
        with self._offload_boundary(carry, args, kwargs):
            output = self._checkpoint(region, *args, **kwargs)
        if end - block_index > 1:
            self._pending = _Pending(list_index, block_index + 1, end, output, args, kwargs,
                                     [(t, t._version) for t in _tensors(output)])
        return output

    def recompute_mismatch(self, error: Exception) -> RecomputeMismatch:
        """The :class:`RecomputeMismatch` of a ``torch.utils.checkpoint.CheckpointError`` raised by
        backward: the region recomputed last is the one that differed."""
        if self.last_recompute is None:
            return RecomputeMismatch("?", (0, 0), 0, False, str(error))
        name, blocks, block, ffn = self.last_recompute
        return RecomputeMismatch(name, blocks, block, ffn, str(error).strip().splitlines()[0])

    def _offload_boundary(self, carry: Carry, args: tuple, kwargs: dict) -> Any:
        """``unsloth``: offload the region's carried inputs (the per-block hidden states); the
        other inputs (temb, rotary embeddings, masks) are shared by every block and stay alive
        on the device anyway, so copying them would save nothing."""
        if self.offloader is None or not self.offload_inputs:
            return _NULL
        return self.offloader.hooks({id(v) for v in carry.carried_inputs(args, kwargs) if isinstance(v, torch.Tensor)})

    @contextlib.contextmanager
    def _block_scope(self, list_index: int, block_index: int, block: torch.nn.Module) -> Iterator[None]:
        """Swap in the FFN checkpoint and the attention offload for one plain block call; a
        streamed block's saved weights are packed as handles that stream it in again."""
        block_list = self.family.block_lists[list_index]
        with contextlib.ExitStack() as stack:
            if (self.streamer is not None and block_index in self._streamed[list_index] and self._region_depth == 0
                    and torch.is_grad_enabled()):
                stack.enter_context(self.streamer.hooks())
            if self._ffn_blocks is not None and block_index in self._ffn_blocks[list_index]:
                self._wrap_ffn(stack, block, block_list)
            if self.offload_attention and block_list.attention and self._region_depth == 0:
                attention = block.get_submodule(block_list.attention)
                original = attention.forward

                def offloaded_attention(*a: Any, **kw: Any) -> Any:
                    with self.offloader.hooks():
                        return original(*a, **kw)

                stack.enter_context(_swap_forward(attention, offloaded_attention))
            yield

    def _wrap_ffn(self, stack: contextlib.ExitStack, block: torch.nn.Module, block_list: BlockList) -> None:
        names = (block_list.ffn,) if isinstance(block_list.ffn, str) else tuple(block_list.ffn)
        modules = [block.get_submodule(n) for n in names]
        list_index, block_index = self._where[id(block)]
        region = _FfnRegion(self, [m.forward for m in modules], (block_list.name, block_index), list_index)
        unsloth = self.offload_inputs

        def checkpointed_ffn(*a: Any, **kw: Any) -> Any:
            self.stats.checkpoint_calls += 1
            a, kw = _snapshot(a), _snapshot(kw)
            select = {id(v) for v in a if isinstance(v, torch.Tensor)} | {
                id(v) for v in kw.values() if isinstance(v, torch.Tensor)}
            with self.offloader.hooks(select) if unsloth else contextlib.nullcontext():
                return self._checkpoint(region, *a, **kw)

        stack.enter_context(_swap_forward(modules[0], checkpointed_ffn))
        for module in modules[1:]:  # a chain (Flux single: act_mlp(proj_mlp(x))) runs inside the region
            stack.enter_context(_swap_forward(module, lambda x: x))

    def _pass_through(self, list_index: int, block_index: int, args: tuple, kwargs: dict) -> Any:
        pending = self._pending
        name = self.family.block_lists[pending.list_index].name
        if (list_index, block_index) != (pending.list_index, pending.next_block):
            raise CarryMismatch(name, f"expected block {pending.next_block}, the loop called "
                                      f"block {block_index} of list {self.family.block_lists[list_index].name!r}")
        changed = [t for t, version in pending.versions if t._version != version]
        if changed:  # e.g. a residual added into the carried hidden state with an in-place op
            raise CarryMismatch(name, f"the loop changed block {block_index - 1}'s output in place before it "
                                      f"called block {block_index}")
        carry = self.family.block_lists[list_index].carry
        want_args, want_kwargs = carry.apply(pending.output, pending.args, pending.kwargs)
        if not (same_arguments(args, want_args) and same_arguments(kwargs, want_kwargs)):
            raise CarryMismatch(name, f"block {block_index} was called with other arguments than "
                                      f"block {block_index - 1} returned")
        pending.next_block += 1
        if pending.next_block == pending.end:
            self._pending = None
        return pending.output
