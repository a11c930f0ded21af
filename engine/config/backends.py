"""The four public checkpoint backends as data, and every block-map mark the plan can show.

One row per public ``gradient_checkpointing_backend`` value (docs/SCHEDULES.md "Backends"; the
documents' SimpleTuner "Unsloth-style Checkpointing"): the scope of its checkpoint region (the
whole block, or the block's feed-forward sub-block alone) and whether the region's boundary
inputs wait in host memory between forward and backward. The block-map marks (character, colour
and label that the printed plan and the schedule node's strip show, :class:`Mark`; the marks of
no backend, plain blocks and the weight stream map, are declared here too) and the
documents' decision order (torch-ffn, torch, unsloth-ffn, unsloth) are kept in the same row.
Everything else reads this table; no other module compares backend names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mark:
    """One block-map character.

    Attributes:
        char: the character in a block map (one per block).
        label: its short name in the strip's legend.
        color: its fill colour on the strip, a CSS ``#rrggbb`` string.
        text: what it means, in the printed plan's legend.
        base: for a mark the strip draws as a band along the top of a block's cell (a stream-map
            mark), the colour under the band in its legend swatch; ``None`` for a cell's fill.
    """

    char: str
    label: str
    color: str
    text: str
    base: str | None = None

    def style(self) -> dict[str, str]:
        """JSON-ready ``{"color": ..., "label": ...}`` (and ``"base"`` when set): what the strip
        draws for this mark."""
        style = {"color": self.color, "label": self.label}
        return style if self.base is None else {**style, "base": self.base}


PLAIN_ATTENTION_OFFLOADED = Mark("a", "plain, attention offloaded", "#f59e0b",
                                 "plain with attention activations offloaded")
"""A block outside any checkpoint region whose attention activations wait in host memory
(``gradient_checkpointing_offload_attention``)."""
PLAIN = Mark(".", "plain", "#52525b", "plain (activations kept)")
"""A block that runs normally, keeping its activations."""
PLAIN_MARKS = (PLAIN_ATTENTION_OFFLOADED, PLAIN)
"""The marks of blocks no backend checkpoints, in legend order (after the backends' marks)."""

STREAMED = Mark("S", "frozen weights streamed", "#f472b6", "frozen weights streamed from host memory",
                base=PLAIN.color)
"""A block whose frozen weights stream from host memory (``weight_offload=stream``): the strip
draws a band of this colour along the top of the block's cell (in the legend, over a plain block)."""
RESIDENT = "."
"""The stream-map character of a block whose frozen weights stay on the device (not drawn)."""
STREAM_MARKS = (STREAMED,)
"""The drawn marks of the stream map (:meth:`~..core.plan.ModelPlan.stream_maps`)."""


@dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        name: the public key value.
        ffn_scope: the region is the block's FFN sub-block (else the whole block or segment).
        offload_inputs: the region's carried boundary inputs are kept in host memory.
        mark: the block-map mark of a block it checkpoints.
        save_attention_mark: the mark of a block it checkpoints that keeps its attention outputs
            (``gradient_checkpointing_save_attention``); ``None`` where that key is refused (an
            FFN-scope region holds no attention, engine/config/schedule.py).
        preference: rank in the documents' decision rule (0 = tried first).
    """

    name: str
    ffn_scope: bool
    offload_inputs: bool
    mark: Mark
    save_attention_mark: Mark | None
    preference: int

    @property
    def marks(self) -> tuple[Mark, ...]:
        """Every mark a block it checkpoints can show: :attr:`mark`, then :attr:`save_attention_mark`."""
        return (self.mark,) if self.save_attention_mark is None else (self.mark, self.save_attention_mark)


TABLE: dict[str, Backend] = {b.name: b for b in (
    Backend("torch", ffn_scope=False, offload_inputs=False, preference=1,
            mark=Mark("C", "checkpointed", "#3b82f6", "checkpointed block (recomputed in backward)"),
            save_attention_mark=Mark("K", "checkpointed, attention outputs kept", "#0ea5e9",
                                     "checkpointed block keeping its attention outputs (save_attention)")),
    Backend("torch-ffn", ffn_scope=True, offload_inputs=False, preference=0, save_attention_mark=None,
            mark=Mark("F", "FFN checkpointed", "#10b981", "FFN checkpointed (torch-ffn)")),
    Backend("unsloth", ffn_scope=False, offload_inputs=True, preference=3,
            mark=Mark("O", "checkpointed, inputs offloaded", "#a855f7",
                      "checkpointed block with its boundary inputs offloaded (unsloth)"),
            save_attention_mark=Mark("k", "checkpointed, inputs and kept attention offloaded", "#c084fc",
                                     "checkpointed block keeping its attention outputs, with its boundary inputs "
                                     "and kept attention outputs offloaded (unsloth, save_attention)")),
    Backend("unsloth-ffn", ffn_scope=True, offload_inputs=True, preference=2, save_attention_mark=None,
            mark=Mark("f", "FFN checkpointed, offloaded", "#14b8a6",
                      "FFN checkpointed with its input offloaded (unsloth-ffn)")),
)}
BACKENDS = tuple(TABLE)
"""Allowed values of ``gradient_checkpointing_backend``, in the order shown to users."""
DEFAULT = TABLE["torch"]
"""The default backend: recompute, nothing offloaded."""


def same_scope_without_offload(backend: Backend) -> Backend:
    """The backend of the same scope that keeps its boundary inputs on the device."""
    return next(b for b in TABLE.values() if b.ffn_scope == backend.ffn_scope and not b.offload_inputs)
