"""Peak-memory and step-time measurement for one training step.

A sweep cell is ``post-warmup sec/step / peak memory GiB``, the peak being the memory allocated
during the training update (docs/SCHEDULES.md "Benchmark protocol"). On CUDA the caching
allocator's own counters give that peak. On CPU there is no such counter (the process RSS is
noisy and includes the allocator's free lists), so :class:`LiveTensorTracker` counts, exactly
and deterministically, the bytes of the tensor storages that the step's operators allocate and
that are still alive. :class:`PeakMemory` picks one of the two; :class:`StepTimer` gives the
post-warm-up median time.

Trackers and timers are objects owned by a run; no module-level mutable state (a ComfyUI server is
long-lived: state left in a module would leak from one workflow into the next).

Example::

    meter = PeakMemory("cpu")
    with meter.measure() as reading:
        loss = step(batch)
        loss.backward()
    print(format_mib(reading.peak_bytes))
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..config.guardrails import check_budget

MIB = 1 << 20
GIB = 1 << 30

# Ops that return a freshly created tensor that is also their input (``torch.tensor(...)`` data).
_FRESH_OPS = (torch.ops.aten.lift_fresh.default,)


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created under it and still alive; keeps their peak.

    Every operator run under the tracker (forward, autograd backward, checkpoint recompute: on
    CPU, autograd runs on the calling thread and the dispatch mode is propagated to it) is
    intercepted. A storage that appears in an operator's outputs and in none of its inputs is a
    new allocation: it is counted once, with ``untyped_storage().nbytes()`` bytes, until it is
    freed. Views, in-place ops and ``out=`` ops share an input's storage and add nothing; storages
    created before the tracker was entered (weights, the batch) are never counted.

    A storage's release is seen through a weak reference to its Python object, which torch keeps
    unique and alive for as long as the C++ storage lives (checked on torch 2.13: the callback
    fires exactly when the last tensor using the storage goes away, not when Python drops the
    storage object). Kernel-internal workspaces that never become a tensor are not seen.

    Args:
        exclude: predicate on a newly created tensor; storages of tensors for which it returns
            True are not counted (e.g. a pinned host pool for offloaded activations, or any
            tensor not on the measured device).

    Attributes:
        current_bytes: bytes of counted storages alive now.
        peak_bytes: highest ``current_bytes`` since entry or the last :meth:`reset_peak`.
    """

    def __init__(self, exclude: Callable[[torch.Tensor], bool] | None = None):
        super().__init__()
        self.exclude = exclude
        self.current_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> (weak reference whose callback releases it, counted bytes)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._keys: dict[weakref.ref, int] = {}  # the same weak reference -> id(storage)
        self._released = functools.partial(_released, weakref.ref(self))  # weak: storages may outlive us
        self._aliasing: dict[Any, bool] = {}  # operator -> whether its results may alias an input

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo, a frame guard on every
        # operator that costs more than the bookkeeping here; this mode never runs under compile
        return False

    @property
    def live_storages(self) -> int:
        """Number of counted storages alive now."""
        return len(self._live)

    def reset_peak(self) -> None:
        """Start a new peak window: ``peak_bytes := current_bytes``."""
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # runs for every operator: kept lean (the mode's own dispatch costs about as much)
        out = func(*args, **kwargs) if kwargs else func(*args)
        input_storages: set[int] | None = None
        for tensor in [out] if type(out) is torch.Tensor else _dense_tensors(out):
            storage = _storage_of(tensor)
            if storage is None:
                continue
            key, nbytes = id(storage), storage.nbytes()
            known = self._live.get(key)
            if known is not None:  # ours already; an in-place resize may have grown it
                if nbytes != known[1]:
                    self._count(key, known[0], nbytes)
                continue
            # an op whose schema says its results alias no input allocated them (the dispatcher
            # checks that contract); a view, in-place or out= op may return an input's storage
            if self._may_alias(func):
                if input_storages is None:
                    input_storages = {id(s) for s in map(_storage_of, _dense_tensors((args, kwargs)))
                                      if s is not None}
                if key in input_storages:  # a view / in-place result of a storage made before us
                    continue
            if self.exclude is None or not self.exclude(tensor):
                ref = weakref.ref(storage, self._released)
                self._keys[ref] = key
                self._count(key, ref, nbytes)
        return out

    def _may_alias(self, func: Any) -> bool:
        """Whether an operator's results may share an input's storage: its schema annotates a
        return as an alias (``Tensor(a)``, ``Tensor(a!)``) or it has no schema to say otherwise
        (and it is not one of :data:`_FRESH_OPS`, whose result is new data)."""
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            schema = getattr(func, "_schema", None)
            aliasing = self._aliasing[func] = func not in _FRESH_OPS and (
                schema is None or any(r.alias_info is not None for r in schema.returns))
        return aliasing

    def _count(self, key: int, ref: weakref.ref, nbytes: int) -> None:
        """Set the counted size of storage ``key`` to ``nbytes`` (bytes) and update the peak."""
        self.current_bytes += nbytes - self._live.get(key, (ref, 0))[1]
        self._live[key] = (ref, nbytes)
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes

    def _release(self, ref: weakref.ref) -> None:
        entry = self._live.pop(self._keys.pop(ref, None), None)
        if entry is not None:
            self.current_bytes -= entry[1]


def _dense_tensors(value: Any) -> list[torch.Tensor]:
    """The dense tensors in an operator's arguments or results: a tensor, or nested lists, tuples
    (``torch.Size``, return structs) and dicts of them (what ``tree_flatten`` gives for aten
    arguments, without its cost on every operator), with every wrapper tensor subclass (FSDP's
    DTensor, torchao's quantized tensors) replaced by the dense tensors holding its data (the ops
    on those run below this mode, so they are counted here, through the wrapper's result)."""
    if type(value) is torch.Tensor:
        return [value]
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if type(item) is not torch.Tensor and is_traceable_wrapper_subclass(item):
                stack.extend(getattr(item, name) for name in item.__tensor_flatten__()[0])
            else:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def _storage_of(value: Any) -> torch.UntypedStorage | None:
    """The storage of a dense tensor with real data; ``None`` for anything else (meta, sparse, ...)."""
    if not isinstance(value, torch.Tensor) or value.is_meta or value.layout != torch.strided:
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None


def _released(owner: weakref.ref, ref: weakref.ref) -> None:
    """Weak-reference callback: the storage behind ``ref``, counted by tracker ``owner``, was freed."""
    tracker = owner()
    if tracker is not None:
        tracker._release(ref)


@dataclass
class MemoryReading:
    """What :meth:`PeakMemory.measure` saw; filled in when the ``with`` block exits.

    Attributes:
        peak_bytes: peak bytes allocated during the block. CUDA: the allocator's
            ``max_memory_allocated`` (absolute: weights and the batch included). CPU: the
            tracker's peak of storages created inside the block (weights excluded).
        baseline_bytes: bytes allocated at entry (CUDA ``memory_allocated``; 0 on CPU).
        end_bytes: bytes still allocated at exit, on the same scale as ``peak_bytes``.
    """

    peak_bytes: int = 0
    baseline_bytes: int = 0
    end_bytes: int = 0

    @property
    def step_bytes(self) -> int:
        """Peak above what was allocated at entry (bytes): the step's own transient memory."""
        return self.peak_bytes - self.baseline_bytes


class PeakMemory:
    """Peak memory of a training step, on CUDA through the allocator, elsewhere by tracking tensors.

    Args:
        device: the device the step runs on.
        exclude: CPU tracker only: tensors whose storage is not counted (see
            :class:`LiveTensorTracker`).
        compiled: the step runs compiled blocks (``compile_blocks``). On the CPU nothing is then
            tracked (the reading stays 0): dynamo runs no compiled code while a dispatch mode such
            as the tracker is active, so tracking would measure an eager step instead. Measure
            compile's memory on CUDA, where the allocator counts it.
    """

    def __init__(self, device: torch.device | str = "cpu", exclude: Callable[[torch.Tensor], bool] | None = None,
                 compiled: bool = False):
        self.device = torch.device(device)
        self.exclude = exclude
        self.compiled = compiled
        self.tracker: LiveTensorTracker | None = None
        """The CPU tracker of the step being measured (None on CUDA and between steps)."""

    @contextmanager
    def measure(self) -> Iterator[MemoryReading]:
        """Measure the peak of the ``with`` block; the yielded reading is complete after exit."""
        reading = MemoryReading()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            reading.baseline_bytes = torch.cuda.memory_allocated(self.device)
            try:
                yield reading
            finally:
                torch.cuda.synchronize(self.device)  # the peak of queued kernels is now recorded
                reading.peak_bytes = torch.cuda.max_memory_allocated(self.device)
                reading.end_bytes = torch.cuda.memory_allocated(self.device)
            return
        if self.compiled:  # see the class docstring: an untracked, compiled step
            yield reading
            return
        with LiveTensorTracker(self.exclude) as tracker:
            self.tracker = tracker
            try:
                yield reading
            finally:
                self.tracker = None
                reading.peak_bytes, reading.end_bytes = tracker.peak_bytes, tracker.current_bytes


def to_gib(nbytes: int | float) -> float:
    """Bytes -> GiB (2**30 bytes)."""
    return nbytes / GIB


def format_mib(nbytes: int | float, digits: int = 2) -> str:
    """Bytes as ``"12.34 MiB"`` (2**20 bytes)."""
    return f"{nbytes / MIB:.{digits}f} MiB"


class StepTimer:
    """Seconds per step (wall clock by default), excluding the first ``warmup`` steps.

    On CUDA the device is synchronized before and after each step so that queued kernels are
    counted in the step that launched them.

    Args:
        device: the device the steps run on.
        warmup: number of leading steps not recorded.
        clock: seconds counter; default :func:`time.perf_counter`. :func:`time.process_time`
            (this process's CPU seconds) is steadier on a CPU shared with other jobs.
    """

    def __init__(self, device: torch.device | str = "cpu", warmup: int = 1,
                 clock: Callable[[], float] | None = None):
        self.device = torch.device(device)
        self.warmup = warmup
        self.clock = clock or time.perf_counter
        self.seen = 0
        self.samples: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time the ``with`` block as one step (recorded only once past the warm-up)."""
        self._sync()
        start = self.clock()
        yield
        self._sync()
        elapsed = self.clock() - start
        self.seen += 1
        if self.seen > self.warmup:
            self.samples.append(elapsed)

    def median_s(self) -> float:
        """Median post-warm-up step time in seconds.

        Raises:
            ValueError: no step has been recorded past the warm-up.
        """
        if not self.samples:
            raise ValueError(f"no step recorded after {self.warmup} warm-up step(s)")
        return statistics.median(self.samples)


def device_budget(device: str | torch.device) -> int:
    """"Fit this device": total accelerator memory (CUDA), else total system memory, in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory(device: str | torch.device) -> int:
    """Memory free now, bytes: the CUDA driver's free device memory, else the host's available
    memory (the kernel's ``MemAvailable`` in ``/proc/meminfo``: free pages plus the page cache and
    buffers it can reclaim; the bare "free" figure leaves those out and reads a fraction of what a
    run can use), or the free pages where that file does not exist."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def host_available_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int:
    """The host's available memory, bytes (see :func:`free_memory`)."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def budget_bytes(value: str | float | int, device: str | torch.device = "cpu", key: str = "budget") -> int:
    """A memory budget in bytes from a number of GiB, ``device`` (the device's total memory) or
    ``free`` (its free memory now).

    Raises:
        ValueError: see :func:`check_budget`.
    """
    checked = check_budget(value, key)
    if isinstance(checked, str):  # "device" / "fit this device": its total memory; "free": free now
        return free_memory(device) if checked == "free" else device_budget(device)
    return int(checked * 2**30)
