"""Weight streaming: the frozen weights of the plan's streamed blocks live in host memory and are
copied host-to-device into a small ring of device slots just before each use.

The unit of a copy is what runs at once: the streamed blocks of one whole-block checkpoint
segment, or one plain block (docs/STREAMING.md). A checkpointed segment reads its weights in
forward and again in its recompute, and autograd keeps no reference to them in between; a plain
block's saved weights (a linear layer's ``W.t()``, a norm's weight) are handed to autograd as a
:class:`WeightRef` by a saved-tensor hook, and unpacking it streams the unit in again. The copies
go host-to-device only (a frozen weight never changes, so nothing is copied back), on a side
stream with one event per copy on CUDA, so compute waits only for the unit it needs; the next
``weight_offload_prefetch`` units in the current direction (forward order, or the reverse order
the recomputes and unpacks of backward take) are copied ahead.

Layout: :class:`StreamStats`, :class:`WeightRef`, :class:`WeightStreamer`. Host memory comes from
the run's :class:`~.offload.HostPool`: views into a few large chunks planned from the streamed bytes
(engine/core/arena.py), pinned where the device allows, plain host memory on a machine without
CUDA, where "device" and host are both CPU memory and the code path is the same.

The rule that the last block of a backward region has run before the region before it is
recomputed is autograd's: its engine runs the ready node with the highest sequence number first,
and a region's nodes were created after those of the region before it.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .arena import aligned
from .offload import HostPool


class StreamingWarning(UserWarning):
    """Weight streaming runs, but not as its options suggest (it saves nothing, say)."""


@dataclass
class StreamStats:
    """Per-step counters of weight streaming (reset by the trainer each step).

    Attributes:
        h2d_bytes: frozen-weight bytes copied host-to-device this step.
        copies: unit copies (a segment's or a plain block's weights) this step.
        d2h_bytes: frozen-weight bytes copied device-to-host (the streamer never does: 0).
        stall_s: seconds compute waited for weight copies (CUDA: measured between events around
            each wait, read at the end of the step; CPU: the copies themselves, which run inline).
        activations: unit activations (uses), hits included.
    """

    h2d_bytes: int = 0
    copies: int = 0
    d2h_bytes: int = 0
    stall_s: float = 0.0
    activations: int = 0
    _waits: list = field(default_factory=list)

    def reset(self) -> None:
        """Zero the counters."""
        self.h2d_bytes = self.copies = self.d2h_bytes = self.activations = 0
        self.stall_s = 0.0
        self._waits.clear()

    def settle(self) -> None:
        """Add the CUDA waits of the step to ``stall_s`` (call after the step synchronised)."""
        for start, end in self._waits:
            self.stall_s += start.elapsed_time(end) / 1000.0
        self._waits.clear()


@dataclass
class _Leaf:
    """One frozen tensor of a unit: where it lives in a slot and how to point its owner there."""

    owner: Any  # an nn.Parameter (its .data is repointed) or a wrapper subclass (an attribute is)
    name: str | None  # attribute of ``owner`` for a wrapper's inner tensor; None for a parameter
    master: torch.Tensor  # the host copy (contiguous)
    offset: int  # byte offset in the slot
    poison: torch.Tensor | None = None  # strict mode: what an evicted leaf points at

    @property
    def nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()

    def point(self, tensor: torch.Tensor) -> None:
        if self.name is None:
            self.owner.data = tensor
        else:
            setattr(self.owner, self.name, tensor)


@dataclass
class _Unit:
    """The streamed blocks that run at once; ``index`` is its position in forward order.

    Its slot layout mirrors where the arena placed its host copies: the leaves in one chunk sit one
    after the other there (placed in order), so each chunk's share is one byte range (a ``run``),
    copied with one call, not one per weight. ``runs``: ``(host bytes, slot offset)``; a leaf that is
    not a plain contiguous host view is a run of its own (copied as a tensor). ``views[k]`` and
    ``copies[k]``: its leaves' views into slot ``k`` and its runs' ``(slot view, host tensor)``,
    built once (the slots never move), so a copy makes no tensor.
    """

    index: int
    blocks: tuple[tuple[int, int], ...]  # (list index, block index)
    leaves: list[_Leaf]
    nbytes: int  # bytes of its slot layout (aligned)
    slot: int | None = None
    copy_bytes: int = 0  # bytes of its leaves (unaligned): what one copy moves
    runs: list[tuple[torch.Tensor, int | None]] = field(default_factory=list)
    views: list[list[torch.Tensor]] = field(default_factory=list)
    copies: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


class WeightRef:
    """What autograd keeps for a saved view of a streamed weight: its unit, and the view's place."""

    __slots__ = ("unit", "byte_offset", "dtype", "shape", "stride")

    def __init__(self, unit: _Unit, byte_offset: int, dtype: torch.dtype, shape: torch.Size, stride: tuple):
        self.unit, self.byte_offset, self.dtype, self.shape, self.stride = unit, byte_offset, dtype, shape, stride


def _leaves(param: torch.Tensor) -> Iterable[tuple[Any, str | None, torch.Tensor]]:
    """``(owner, attribute or None, tensor)`` of a parameter's plain tensors: the parameter
    itself, or the inner tensors of a wrapper subclass (torchao's data, scale, zero point)."""
    if not is_traceable_wrapper_subclass(param):
        yield param, None, param.data
        return
    for name in param.__tensor_flatten__()[0]:
        inner = getattr(param, name)
        if not isinstance(inner, torch.Tensor):  # e.g. a DTensor's mesh
            continue
        if is_traceable_wrapper_subclass(inner):
            yield from ((o, n, t) for o, n, t in _leaves(inner))
        else:
            yield param, name, inner


def _layout(leaves: list[_Leaf]) -> tuple[list[tuple[torch.Tensor, int | None]], int]:
    """Set each leaf's slot ``offset`` so that the leaves of one host storage (an arena chunk) keep
    their relative places; returns the runs (:class:`_Unit`) and the unit's slot bytes.

    A storage's leaves are one run when they fill its byte range (aligned, nothing else between);
    otherwise, and for a leaf that is not a contiguous view, each leaf is a run of its own (its
    host tensor; slot offset None: copied into its view).
    """
    groups: dict[int, list[tuple[int, _Leaf]]] = {}
    single: list[_Leaf] = []
    for leaf in leaves:
        m = leaf.master
        if leaf.nbytes and m.is_contiguous() and m.layout == torch.strided:
            groups.setdefault(m.untyped_storage().data_ptr(), []).append((m.storage_offset() * m.element_size(), leaf))
        else:
            single.append(leaf)
    runs, offset = [], 0
    for members in groups.values():
        members.sort(key=lambda hl: hl[0])
        first, last = members[0], members[-1]
        span = last[0] + last[1].nbytes - first[0]
        if aligned(span) != sum(aligned(leaf.nbytes) for _, leaf in members):
            single += [leaf for _, leaf in members]  # not one range of these leaves alone
            continue
        for host, leaf in members:
            leaf.offset = offset + host - first[0]
        source = first[1].master
        runs.append((torch.empty(0, dtype=torch.uint8, device=source.device).set_(
            source.untyped_storage(), first[0], (span,), (1,)), offset))
        offset += aligned(span)
    for leaf in single:
        leaf.offset = offset
        runs.append((leaf.master, None))
        offset += aligned(leaf.nbytes)
    return runs, offset


def _frozen_leaves(modules: list[torch.nn.Module]) -> Iterable[tuple[Any, str | None, torch.Tensor]]:
    """The streamed leaves of one unit's modules, each parameter once, in the order the unit holds
    them: parameters that require grad (the LoRA, anything trainable) stay resident."""
    seen: set[int] = set()
    for module in modules:
        for _, param in module.named_parameters():
            if id(param) in seen or param.requires_grad:
                continue
            seen.add(id(param))
            yield from _leaves(param)


class WeightStreamer:
    """Streams the frozen weights of a plan's streamed blocks through a ring of device slots.

    Args:
        units: per unit in forward order, its blocks ``(list index, block index)`` and modules.
        pool: the run's host pool (master copies are held there: pinned on CUDA).
        device: where the slots live.
        prefetch: ``weight_offload_prefetch``; the ring has ``prefetch + 1`` slots (at most one per unit).
        recomputing: callable, True while the runner recomputes a region (backward order).
        stream: the copy stream to share (the activation offloader's); default: a new one on CUDA.
        strict: point the leaves of a unit that is not in a slot at NaN-filled copies instead of
            their host copies, so that a read outside a use poisons the result (a test of the
            mechanism; it costs one more copy of the streamed weights).

    Attributes:
        stats: :class:`StreamStats`. slot_bytes: bytes of one slot. streamed_bytes: bytes of all
        master copies (host). slot_storages: the slots' storage pointers (allocated once).

    Parameters that require grad (the LoRA, anything trainable) are never streamed.
    """

    def __init__(self, units: list[tuple[tuple[tuple[int, int], ...], list[torch.nn.Module]]], pool: HostPool,
                 device: torch.device, prefetch: int = 1, recomputing: Callable[[], bool] = lambda: False,
                 stream: Any = None, strict: bool = False):
        self.pool, self.device, self.prefetch, self.recomputing, self.strict = pool, device, prefetch, recomputing, strict
        self.stats = StreamStats()
        self.cuda = device.type == "cuda"
        self._stream = stream if stream is not None or not self.cuda else torch.cuda.Stream(device)
        self.units: list[_Unit] = []
        self.by_block: dict[tuple[int, int], _Unit] = {}
        self._handles: list[Any] = []
        self._ready_modules: list[torch.nn.Module] = []
        pool.reserve([t.numel() * t.element_size() for _, modules in units for _, _, t in _frozen_leaves(modules)])
        for index, (blocks, modules) in enumerate(units):
            unit = self._make_unit(index, blocks, modules)
            self.units.append(unit)
            self.by_block.update({b: unit for b in blocks})
        self.streamed_bytes = sum(leaf.nbytes for u in self.units for leaf in u.leaves)
        self.slot_bytes = max((u.nbytes for u in self.units), default=0)
        count = min(prefetch + 1, len(self.units))  # more slots than units would hold nothing new
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self.slot_storages = [s.untyped_storage().data_ptr() for s in self.slots]
        for unit in self.units:
            unit.views = [[self._slot_view(k, leaf) for leaf in unit.leaves] for k in range(count)]
            by_leaf = {id(leaf.master): n for n, leaf in enumerate(unit.leaves)}
            unit.copies = [[(self.slots[k][start: start + src.numel()] if start is not None
                             else unit.views[k][by_leaf[id(src)]], src) for src, start in unit.runs]
                           for k in range(count)]
        self._slot_of_ptr = {ptr: k for k, ptr in enumerate(self.slot_storages)}
        if self.units and self.resident_slot_bytes >= self.streamed_bytes:
            warnings.warn(f"weight_offload=stream saves no device memory here: the ring of {count} slot(s) of "
                          f"{self.slot_bytes} bytes holds as much as the {len(self.units)} streamed unit(s) "
                          f"({self.streamed_bytes} bytes); stream more blocks (weight_offload_blocks) or copy fewer "
                          "ahead (weight_offload_prefetch)", StreamingWarning, stacklevel=3)
        self._slot_unit: list[_Unit | None] = [None] * count
        self._events: list[Any] = [None] * count
        self.active: _Unit | None = None
        for (blocks, modules), unit in zip(units, self.units):
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(unit)))
                for sub in module.modules():  # torchao layers read their weight again in backward
                    if hasattr(type(sub), "weight_ready"):
                        sub.weight_ready = self._ready(unit)
                        self._ready_modules.append(sub)

    def _make_unit(self, index: int, blocks: tuple, modules: list[torch.nn.Module]) -> _Unit:
        leaves = []
        for owner, attr, tensor in _frozen_leaves(modules):
            leaf = _Leaf(owner, attr, self.pool.hold(tensor), 0)
            leaves.append(leaf)
            self._point_out(leaf)  # the original is freed here: the host copy is a view into a chunk
        runs, nbytes = _layout(leaves)
        return _Unit(index, tuple(blocks), leaves, nbytes, copy_bytes=sum(leaf.nbytes for leaf in leaves), runs=runs)

    # -- pointers ---------------------------------------------------------------------------

    def _evict_pointers(self, unit: _Unit) -> None:
        """Point a unit's leaves at their host copies (poison when strict): out of the ring."""
        for leaf in unit.leaves:
            self._point_out(leaf)

    def _point_out(self, leaf: _Leaf) -> None:
        if not self.strict:
            leaf.point(leaf.master)
            return
        if leaf.poison is None:
            leaf.poison = torch.full_like(leaf.master, float("nan") if leaf.master.is_floating_point() else 0)
        leaf.point(leaf.poison)

    def _slot_view(self, k: int, leaf: _Leaf) -> torch.Tensor:
        raw = self.slots[k][leaf.offset: leaf.offset + leaf.nbytes]
        return raw.view(leaf.master.dtype).view(leaf.master.shape)

    # -- copies ---------------------------------------------------------------------------

    def _free_slot(self, keep: set[int]) -> int:
        for k, held in enumerate(self._slot_unit):
            if held is None:
                return k
        for k, held in enumerate(self._slot_unit):
            if held.index not in keep:
                return k
        raise RuntimeError("weight streaming: every slot is in use")  # pragma: no cover (keep <= slots)

    def _load(self, unit: _Unit, keep: set[int]) -> None:
        """Copy ``unit`` host-to-device into a free slot (one not holding a unit in ``keep``)."""
        k = self._free_slot(keep)
        if self._slot_unit[k] is not None:
            old = self._slot_unit[k]
            old.slot = None
            self._evict_pointers(old)
        started = time.perf_counter()
        if self.cuda:
            # the slot's previous readers were queued on the compute stream before this point
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._copy(unit, k, non_blocking=True)
                self._events[k] = self._stream.record_event()
        else:
            self._copy(unit, k)
            self.stats.stall_s += time.perf_counter() - started
        for leaf, view in zip(unit.leaves, unit.views[k]):
            leaf.point(view)
        self._slot_unit[k], unit.slot = unit, k
        self.stats.copies += 1
        self.stats.h2d_bytes += unit.copy_bytes

    def _copy(self, unit: _Unit, k: int, non_blocking: bool = False) -> None:
        """Copy ``unit``'s host copies into slot ``k``: one call per run (per arena chunk it lies in)."""
        for dst, src in unit.copies[k]:
            dst.copy_(src, non_blocking=non_blocking)

    def _wait(self, unit: _Unit) -> None:
        event = self._events[unit.slot]
        if not self.cuda or event is None or event.query():
            return
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        compute.record_event(start)
        compute.wait_event(event)
        compute.record_event(end)
        self.stats._waits.append((start, end))

    def activate(self, unit: _Unit, backward: bool = False) -> None:
        """Make ``unit``'s weights usable on the device now, and copy the next units ahead.

        Args:
            backward: the next units are the ones before it (recompute and unpack order);
                otherwise the ones after it (forward), wrapping round to the first unit when no
                graph is being built (sampling calls the model again from its first block).
        """
        self.stats.activations += 1
        if unit.slot is None:
            self._load(unit, {unit.index})
        self._wait(unit)
        if self.active is unit:
            return
        self.active = unit
        step, n = (-1 if backward else 1), len(self.units)
        wrap = not backward and not torch.is_grad_enabled()
        ahead = [unit.index + step * j for j in range(1, self.prefetch + 1)]
        ahead = [i % n for i in ahead] if wrap else [i for i in ahead if 0 <= i < n]
        keep = {unit.index, *ahead}
        for i in ahead:
            if self.units[i].slot is None:
                self._load(self.units[i], keep)

    def _pre_hook(self, unit: _Unit) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.activate(unit, backward=self.recomputing())
        return hook

    def _ready(self, unit: _Unit) -> Callable[[], None]:
        def ready() -> None:
            self.activate(unit, backward=True)
        return ready

    # -- saved tensors of plain blocks -------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        """A :class:`WeightRef` for a saved view of a streamed weight in a slot; ``tensor`` otherwise."""
        if is_traceable_wrapper_subclass(tensor) or tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        k = self._slot_of_ptr.get(tensor.untyped_storage().data_ptr())
        if k is None or self._slot_unit[k] is None:
            return tensor
        # a unit has the same layout in every slot: the byte offset holds wherever it is streamed to
        return WeightRef(self._slot_unit[k], tensor.storage_offset() * tensor.element_size(), tensor.dtype,
                         tensor.shape, tensor.stride())

    def unpack(self, saved: Any) -> torch.Tensor:
        """Stream a :class:`WeightRef`'s unit in (backward order) and return the view again."""
        if not isinstance(saved, WeightRef):
            return saved
        self.activate(saved.unit, backward=True)
        flat = self.slots[saved.unit.slot].view(saved.dtype)
        return flat.as_strided(saved.shape, saved.stride, saved.byte_offset // saved.dtype.itemsize)

    def hooks(self) -> Any:
        """Saved-tensor hooks for a plain streamed block: its saved weights become :class:`WeightRef`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- the run ------------------------------------------------------------------------------

    @property
    def resident_slot_bytes(self) -> int:
        """Device bytes of the ring (allocated once)."""
        return self.slot_bytes * len(self.slots)

    def close(self) -> None:
        """Point every streamed weight at its host copy and drop the ring and the hooks; the model
        keeps working (its streamed weights in host memory)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._ready_modules:
            module.weight_ready = None
        self._ready_modules.clear()
        for unit in self.units:
            for leaf in unit.leaves:
                leaf.point(leaf.master)
            unit.slot, unit.views, unit.copies = None, [], []  # these views hold the slots' storage
        self.slots, self._slot_unit, self._slot_of_ptr, self.active = [], [], {}, None


def frozen_device_bytes(model: torch.nn.Module, is_host: Callable[[torch.Tensor], bool],
                        skip: set[int] = frozenset()) -> int:
    """Bytes of ``model``'s frozen parameters and buffers held on the device: each storage once,
    host copies (``is_host``) and the storages in ``skip`` (a streamer's ring) left out.

    Args:
        model: the training model. is_host: the run's :meth:`~.offload.HostPool.is_host`.
        skip: storage pointers not to count.
    """
    seen, total = set(skip), 0
    tensors = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    for tensor in tensors:
        for _, _, leaf in _leaves(tensor):
            ptr = leaf.untyped_storage().data_ptr()
            if ptr in seen or is_host(leaf):
                continue
            seen.add(ptr)
            total += leaf.untyped_storage().nbytes()
    return total


def predicted_copies(units: int, prefetch: int, first_step: bool) -> int:
    """Unit copies of one training step when every unit is used once in forward and once in
    backward: ``2 * units`` less the units still in the ring when they are needed again (the
    last ``prefetch + 1`` at the turn to backward; the first ``prefetch + 1`` at the next step's
    start, after the first step). Sampling and OOM retries add their own."""
    ring = min(units, prefetch + 1)
    return 2 * units - ring - (0 if first_step else ring)
