"""Checkpointed regions that keep their attention outputs: PyTorch's selective activation
checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with a policy that
saves the outputs of the fused attention kernels and recomputes everything else
(``gradient_checkpointing_save_attention``).

The kernels are matched by their exact dispatcher operator, as the policy sees them (hao-ai-lab/
FastVideo PR #1716: a policy that names another operator silently saves nothing):
:data:`ATTENTION_OPS` are the fused scaled-dot-product attention operators (flash, memory-efficient,
cuDNN, the CPU flash kernel, the fused "overrideable" one), each of which returns the attention
output with its logsumexp and the random state that backward reads. A family whose attention
calls another kernel declares it (``FamilyAdapter.attention_ops``). The math SDPA path is a
composite that is decomposed (matmul, softmax, ...) before a dispatch policy sees it, so a region
whose attention ran on it saves nothing: :class:`AttentionSaving` counts those regions and the run
says so once, claiming no saving.

With ``unsloth`` the saved outputs go to host memory with the region's boundary inputs (after the
region's forward) and come back when its recompute starts; the selective checkpoint's cache
entries (``torch.utils.checkpoint._VersionWrapper``) are rewritten in place for that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, _VersionWrapper, create_selective_checkpoint_contexts

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


class _CountCalls(TorchDispatchMode):
    """Counts the attention kernels that actually run (below the selective checkpoint's cache)."""

    def __init__(self, ops: frozenset, stats: AttentionStats):
        super().__init__()
        self.ops, self.stats = ops, stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            self.stats.recomputed_calls += 1
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

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """Save the attention kernels' outputs, recompute the rest."""
        if op in self.ops:
            if not ctx.is_recompute:
                self._seen += 1
                self.stats.saved_outputs += 1
                self.stats.saved_bytes += _tensor_bytes(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Around a region's forward: counts it as unsaved when no attention kernel was seen."""
        seen = self._seen
        yield
        if self._seen == seen:
            self.stats.unsaved_regions += 1

    def __call__(self) -> tuple[Any, Any]:
        """``(forward context, recompute context)`` of one checkpoint call."""
        forward, recompute = create_selective_checkpoint_contexts(self.policy)
        counting = _CountCalls(self.ops, self.stats)
        if self.offload is None:
            return forward, _stacked(counting, recompute)
        to_host, to_device, handle = self.offload
        return _after(forward, lambda: _move(forward.storage, self.ops, to_host, torch.Tensor)), _stacked(
            counting, _before(recompute, lambda: _move(recompute.storage, self.ops, to_device, handle)))


def _move(storage: dict, ops: frozenset, copy: Callable[[Any], Any], kind: type) -> None:
    """Rewrite the cached outputs of the attention kernels in ``storage`` (values of ``kind``) with
    ``copy`` of them (the checkpoint reads each entry once, in its recompute)."""
    for key, entries in storage.items():
        if (key[0] if isinstance(key, tuple) else key) not in ops:
            continue
        for index, entry in list(entries.items()):
            entries[index] = tree_map(lambda w: _VersionWrapper(copy(w.val)) if isinstance(w, _VersionWrapper)
                                      and isinstance(w.val, kind) else w, entry)


@contextlib.contextmanager
def _stacked(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


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
