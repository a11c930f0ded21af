"""What a block-map character means and how the schedule node's strip draws it: one declaration.

The printed plan (:meth:`~..core.plan.ModelPlan.render`) and the block strip of the Gradient
Checkpointing Schedule node (``web/schedule_strip.js``, from the plan that ``GET /segckpt/plan``
serves) both read these. A checkpoint backend declares its own marks in its row of the backend
table (``backends.py``); the marks below belong to no backend: the plain blocks and the weight
stream map. ``tests/core/test_marks.py`` ties every mark the engine can emit to one of them.
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
