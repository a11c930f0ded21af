"""Plots with matplotlib (headless Agg backend): a run's loss curve, a sweep's memory/speed map."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..families.lazy import lazy_imports


def loss_curve_rgb(history: list[dict[str, Any]], title: str = "", width_px: int = 640,
                   height_px: int = 360) -> np.ndarray:
    """Render loss per optimizer step: ``(H, W, 3)`` uint8 array.

    Args:
        history: per-step records with ``step`` and ``loss`` (report.json's ``steps``).
        title: plot title (e.g. family and schedule mode).
        width_px, height_px: image size in pixels.
    """
    with lazy_imports():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

    figure = Figure(figsize=(width_px / 100, height_px / 100), dpi=100)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [h["step"] for h in history]
    axes.plot(steps, [h["loss"] for h in history], marker="o", markersize=3, linewidth=1.2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def sweep_plot_png(cells, family: str, budget_bytes: int | None = None, width_px: int = 800,
                   height_px: int = 520) -> bytes:
    """Peak memory (GiB) against sec/step, one labelled point per measured sweep cell, with the
    memory budget as a horizontal line: PNG bytes.

    Args:
        cells: :class:`~.sweep.SweepCell` list; only ``ok`` cells are plotted.
        family: shown in the title.
        budget_bytes: the budget line, when given.
    """
    with lazy_imports():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

    figure = Figure(figsize=(width_px / 100, height_px / 100), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    measured = [c for c in cells if c.status == "ok"]
    xs = [c.sec_per_step for c in measured]
    ys = [c.peak_bytes / 2**30 for c in measured]
    points = axes.scatter(xs, ys, s=24, zorder=3)
    for cell, x, y in zip(measured, xs, ys):
        axes.annotate(cell.mode, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if budget_bytes:
        axes.axhline(budget_bytes / 2**30, color="tab:red", linestyle="--", linewidth=1, label="budget")
        axes.legend(loc="upper right", fontsize=8)
    axes.set_xlabel("sec/step")
    axes.set_ylabel("peak GiB")
    axes.set_title(f"checkpointing sweep: {family} ({len(measured)} measured modes)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    out = io.BytesIO()
    # the number of points actually drawn, readable by tools and tests (PNG tEXt chunk)
    figure.savefig(out, format="png", metadata={"segckpt:points": str(len(points.get_offsets()))})
    return out.getvalue()
