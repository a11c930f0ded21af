"""The four public checkpoint backends as data: what a planned block does under each.

One row per public ``gradient_checkpointing_backend`` value (docs/SCHEDULES.md "Backends"; the
documents' SimpleTuner "Unsloth-style Checkpointing"): the scope of its checkpoint region (the
whole block, or the block's feed-forward sub-block alone) and whether the region's boundary
inputs wait in host memory between forward and backward. The block-map character and the
documents' decision order (torch-ffn, torch, unsloth-ffn, unsloth) are kept in the same row.
Everything else reads this table; no other module compares backend names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        name: the public key value.
        ffn_scope: the region is the block's FFN sub-block (else the whole block or segment).
        offload_inputs: the region's carried boundary inputs are kept in host memory.
        mark: the block-map character of a block it checkpoints.
        preference: rank in the documents' decision rule (0 = tried first).
    """

    name: str
    ffn_scope: bool
    offload_inputs: bool
    mark: str
    preference: int


TABLE: dict[str, Backend] = {b.name: b for b in (
    Backend("torch", ffn_scope=False, offload_inputs=False, mark="C", preference=1),
    Backend("torch-ffn", ffn_scope=True, offload_inputs=False, mark="F", preference=0),
    Backend("unsloth", ffn_scope=False, offload_inputs=True, mark="O", preference=3),
    Backend("unsloth-ffn", ffn_scope=True, offload_inputs=True, mark="f", preference=2),
)}
BACKENDS = tuple(TABLE)
"""Allowed values of ``gradient_checkpointing_backend``, in the order shown to users."""
DEFAULT = TABLE["torch"]
"""The default backend: recompute, nothing offloaded."""


def same_scope_without_offload(backend: Backend) -> Backend:
    """The backend of the same scope that keeps its boundary inputs on the device."""
    return next(b for b in TABLE.values() if b.ffn_scope == backend.ffn_scope and not b.offload_inputs)
