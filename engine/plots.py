"""Plots of a run with matplotlib (headless Agg backend): the loss curve as an RGB array."""

from __future__ import annotations

from typing import Any

import numpy as np


def loss_curve_rgb(history: list[dict[str, Any]], title: str = "", width_px: int = 640,
                   height_px: int = 360) -> np.ndarray:
    """Render loss per optimizer step: ``(H, W, 3)`` uint8 array.

    Args:
        history: per-step records with ``step`` and ``loss`` (report.json's ``steps``).
        title: plot title (e.g. family and schedule mode).
        width_px, height_px: image size in pixels.
    """
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
