"""Checkpointed regions that keep their attention outputs (``gradient_checkpointing_save_attention``):
selective activation checkpointing through :func:`torch.utils.checkpoint.checkpoint`'s
``context_fn``, as PyTorch's ``create_selective_checkpoint_contexts`` does it (a dispatch mode in
the region's forward that keeps chosen operators' outputs, one in its recompute that returns them),
narrowed to the attention kernels: torch's version records every operator and refuses a recompute
whose other operators differ from the forward's, which weight streaming's copies (made in the
recompute, not in the forward) do; these modes look at the attention kernels only.

The kernels are matched by their exact dispatcher operator, as a dispatch mode sees them (hao-ai-lab/
FastVideo PR #1716: a policy that names another operator silently saves nothing):
:data:`ATTENTION_OPS` are the fused scaled-dot-product attention operators (flash, memory-efficient,
cuDNN, the CPU flash kernel, the fused "overrideable" one), each of which returns the attention
output with its logsumexp and the random state that backward reads. A family whose attention
calls another kernel declares it (``FamilyAdapter.attention_ops``). The math SDPA path is a
composite that is decomposed (matmul, softmax, ...) before a dispatch mode sees it, so a region
whose attention ran on it saves nothing: :class:`AttentionSaving` counts those regions and the run
says so once, claiming no saving.

With ``unsloth`` the saved outputs go to host memory with the region's boundary inputs (after the
region's forward) and come back when its recompute starts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_aten = torch.ops.aten
ATTENTION_OPS = tuple(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(_aten, name))
"""The fused SDPA operators whose outputs are saved (``torch.nn.functional.scaled_dot_product_attention``
dispatches to one of them unless it takes the math path)."""


@dataclass
class AttentionStats:
    """What attention saving did in one step (``report.json``, per step).

    Attributes:
        saved_outputs: attention kernel calls whose outputs were saved in forward.
        saved_bytes: their bytes (output, logsumexp and the rest the kernel returns), device or host.
        recomputed_calls: attention kernel calls that ran again during backward recompute (0 where
            the saving works; counted on the regions that use it).
        unsaved_regions: checkpointed regions whose forward ran no fused attention kernel (the
            math path, or a kernel not declared): nothing saved there.
    """

    saved_outputs: int = 0
    saved_bytes: int = 0
    recomputed_calls: int = 0
    unsaved_regions: int = 0

    def reset(self) -> None:
        """Zero the counters."""
        self.saved_outputs = self.saved_bytes = self.recomputed_calls = self.unsaved_regions = 0


class _Keep(TorchDispatchMode):
    """A region's forward: the attention kernels' outputs are kept (detached, in call order)."""

    def __init__(self, saving: "AttentionSaving", kept: list):
        super().__init__()
        self.saving, self.kept = saving, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.saving.ops:
            self.kept.append(tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out))
            self.saving.counted(out)
        return out


class _Reuse(TorchDispatchMode):
    """A region's recompute: each attention kernel call returns what the forward kept, in order;
    every other operator runs again (weight-streaming copies, recompute-only bookkeeping included)."""

    def __init__(self, saving: "AttentionSaving", kept: list):
        super().__init__()
        self.saving, self.kept, self.next = saving, kept, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.saving.ops and self.next < len(self.kept):
            out, self.kept[self.next] = self.kept[self.next], None  # handed over once
            self.next += 1
            return out
        if func in self.saving.ops:  # more attention calls than the forward made: run it, counted
            self.saving.stats.recomputed_calls += 1
        return func(*args, **(kwargs or {}))


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class AttentionSaving:
    """The ``context_fn`` of :func:`torch.utils.checkpoint.checkpoint` for regions that keep their
    attention outputs; one per runner.

    Args:
        extra_ops: a family's own attention operators (``FamilyAdapter.attention_ops``).
        offload: ``(to_host, to_device, handle type)``: a tensor to a host handle and back
            (``unsloth``: :meth:`~.offload.Offloader.offload` and :meth:`~.offload.Offloader.unpack`),
            or None (the outputs stay on the device).
    """

    def __init__(self, extra_ops: tuple = (), offload: tuple[Callable, Callable, type] | None = None):
        self.ops = frozenset(ATTENTION_OPS + tuple(extra_ops))
        self.offload = offload
        self.stats = AttentionStats()
        self.warned = False  # the run said once that some regions saved nothing
        self._seen = 0

    def counted(self, out: Any) -> None:
        """Count one kept attention output (its bytes)."""
        self._seen += 1
        self.stats.saved_outputs += 1
        self.stats.saved_bytes += _tensor_bytes(out)

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Around a region's forward: counts it as unsaved when no attention kernel was seen."""
        seen = self._seen
        yield
        if self._seen == seen:
            self.stats.unsaved_regions += 1

    def __call__(self) -> tuple[Any, Any]:
        """``(forward context, recompute context)`` of one checkpoint call (its ``context_fn``)."""
        kept: list = []
        forward, recompute = _Keep(self, kept), _Reuse(self, kept)
        if self.offload is None:
            return forward, recompute
        to_host, to_device, handle = self.offload
        return (_after(forward, lambda: _move(kept, to_host, torch.Tensor)),
                _before(recompute, lambda: _move(kept, to_device, handle)))


def _move(kept: list, copy: Callable[[Any], Any], kind: type) -> None:
    """Rewrite the kept attention outputs (values of ``kind``) with ``copy`` of them."""
    for index, entry in enumerate(kept):
        kept[index] = tree_map(lambda x: copy(x) if isinstance(x, kind) else x, entry)


@contextlib.contextmanager
def _after(context: Any, then: Callable[[], None]) -> Iterator[None]:
    with context:
        yield
    then()


@contextlib.contextmanager
def _before(context: Any, first: Callable[[], None]) -> Iterator[None]:
    first()
    with context:
        yield
