"""Plots with matplotlib (headless Agg backend): a run's loss curve and its loss by noise level, a sweep's
memory/speed map."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..families.lazy import lazy_imports


def loss_figure(history: list[dict[str, Any]], title: str = "", noise_levels: dict[str, Any] | None = None,
                width_px: int = 640, height_px: int = 360):
    """The loss per optimizer step and, given ``noise_levels``, beneath it the mean loss per noise-level
    bin with each bin's sample count: a matplotlib ``Figure`` (Agg canvas attached, 100 dpi).

    Args:
        history: per-step records with ``step`` and ``loss`` (report.json's ``steps``).
        title: plot title (e.g. family and schedule mode).
        noise_levels: report.json's ``loss_by_noise_level`` (``engine/train/report.py``); None: the
            loss curve alone.
        width_px, height_px: the size of each plot in pixels (the figure is twice as tall with two).
    """
    with lazy_imports():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

    rows = 1 if noise_levels is None else 2
    figure = Figure(figsize=(width_px / 100, rows * height_px / 100), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(rows, 1, 1)
    axes.plot([h["step"] for h in history], [h["loss"] for h in history], marker="o", markersize=3, linewidth=1.2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if noise_levels is not None:
        _noise_level_bars(figure.add_subplot(rows, 1, 2), noise_levels)
    figure.tight_layout()
    return figure


def _noise_level_bars(axes, noise_levels: dict[str, Any]) -> None:
    """The mean loss of each non-empty noise-level bin as a bar over its span, its count above it."""
    full = [b for b in noise_levels["bins"] if b["count"]]
    bars = axes.bar([b["low"] for b in full], [b["mean_loss"] for b in full],
                    width=[b["high"] - b["low"] for b in full], align="edge", edgecolor="white", alpha=0.8)
    axes.bar_label(bars, labels=[f"n={b['count']}" for b in full], fontsize=7, padding=2)
    axes.set_xlim(0, 1)
    axes.margins(y=0.15)
    axes.set_xlabel("noise level (sigma; epsilon families t/1000)")
    axes.set_ylabel("mean loss (unweighted MSE)")
    axes.set_title(f"loss by noise level ({noise_levels['samples']} samples)")
    axes.grid(alpha=0.3, axis="y")


def loss_curve_rgb(history: list[dict[str, Any]], title: str = "", width_px: int = 640,
                   height_px: int = 360, noise_levels: dict[str, Any] | None = None) -> np.ndarray:
    """Render :func:`loss_figure`: ``(H, W, 3)`` uint8 array (``H`` is ``2 * height_px`` with ``noise_levels``)."""
    figure = loss_figure(history, title, noise_levels, width_px, height_px)
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def loss_graph_png(history: list[dict[str, Any]], title: str = "",
                   noise_levels: dict[str, Any] | None = None) -> bytes:
    """:func:`loss_figure` as PNG bytes; its tEXt chunk ``segckpt:noise_bins`` holds the number of
    noise-level bars drawn (for tools and tests)."""
    figure = loss_figure(history, title, noise_levels)
    drawn = len(figure.axes[1].patches) if noise_levels is not None else 0
    out = io.BytesIO()
    figure.savefig(out, format="png", metadata={"segckpt:noise_bins": str(drawn)})
    return out.getvalue()


LABEL_POINTS = 6
"""Font size of a sweep point's label, points."""
MARGINS_PX = {"left": 72, "bottom": 48, "top": 36, "gap": 14}
"""The sweep plot's margins around the axes, pixels (at 100 dpi); ``gap``: between the axes and
the column of labels on their right."""


def sweep_figure(cells, family: str, budget_bytes: int | None = None, width_px: int = 800,
                 height_px: int = 520):
    """Peak memory (GiB) against sec/step, one point per measured sweep cell, each named by a label
    in a column right of the axes with a leader line to its point, and the memory budget as a
    horizontal line: a matplotlib ``Figure`` (Agg canvas attached, 100 dpi).

    Labels never overlap, however close the points (at tiny sizes many modes measure within noise
    of each other): each label sits at its point's height, pushed apart just enough to keep one
    text line between neighbours (:func:`spread`), and the figure grows taller when the column
    needs it.

    Args:
        cells: :class:`~.sweep.SweepCell` list; only ``ok`` cells are plotted.
        family: shown in the title.
        budget_bytes: the budget line, when given.
        width_px, height_px: figure size in pixels (the height is the least: it grows with the labels).
    """
    with lazy_imports():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

    measured = [c for c in cells if c.status == "ok"]
    figure = Figure(dpi=100)
    canvas = FigureCanvasAgg(figure)
    sizes = [_text_size(figure, canvas.get_renderer(), c.mode) for c in measured]
    line = max((h for _, h in sizes), default=0.0) + 2  # one label's height and a 2 px gap
    m = MARGINS_PX
    height = max(height_px, m["top"] + m["bottom"] + line * len(measured))
    figure.set_size_inches(width_px / 100, height / 100)
    right = width_px - max((w for w, _ in sizes), default=0.0) - m["gap"] - 6
    axes = figure.add_axes((m["left"] / width_px, m["bottom"] / height, (right - m["left"]) / width_px,
                            (height - m["top"] - m["bottom"]) / height))
    xs = [c.sec_per_step for c in measured]
    ys = [c.peak_bytes / 2**30 for c in measured]
    axes.scatter(xs, ys, s=24, zorder=3)
    if budget_bytes:
        axes.axhline(budget_bytes / 2**30, color="tab:red", linestyle="--", linewidth=1, label="budget")
        axes.legend(loc="upper right", fontsize=8)
    axes.set_xlim(axes.get_xlim())  # fixed from here: the labels are placed against these limits
    axes.set_ylim(axes.get_ylim())
    heights = [axes.transData.transform((x, y))[1] for x, y in zip(xs, ys)]
    for cell, x, y, at in zip(measured, xs, ys, spread(heights, line, m["bottom"], height - m["top"])):
        axes.annotate(cell.mode, (x, y), xytext=(right + m["gap"], at), textcoords="figure pixels",
                      fontsize=LABEL_POINTS, ha="left", va="center", annotation_clip=False,
                      arrowprops={"arrowstyle": "-", "color": "0.6", "linewidth": 0.5, "shrinkA": 0, "shrinkB": 3})
    axes.set_xlabel("sec/step")
    axes.set_ylabel("peak GiB")
    axes.set_title(f"checkpointing sweep: {family} ({len(measured)} measured modes)")
    axes.grid(alpha=0.3)
    return figure


def spread(targets: list[float], gap: float, low: float, high: float) -> list[float]:
    """Positions on one axis, each as near its target as the others allow, at least ``gap`` apart
    and within ``[low + gap/2, high - gap/2]`` (two passes over the sorted targets: push up from
    below, then down from the top). Needs ``len(targets) * gap <= high - low``.

    Args:
        targets: wanted centres (pixels). gap: the least distance between two centres (pixels).
        low, high: the span the items must stay in (pixels).
    """
    order = sorted(range(len(targets)), key=targets.__getitem__)
    at = list(targets)
    edge = low - gap / 2
    for i in order:
        at[i] = edge = max(targets[i], edge + gap)
    edge = high + gap / 2
    for i in reversed(order):
        at[i] = edge = min(at[i], edge - gap)
    return at


def _text_size(figure, renderer, text: str) -> tuple[float, float]:
    """(width, height) in pixels of ``text`` drawn as a sweep label."""
    artist = figure.text(0, 0, text, fontsize=LABEL_POINTS)
    box = artist.get_window_extent(renderer)
    artist.remove()
    return box.width, box.height


def sweep_plot_png(cells, family: str, budget_bytes: int | None = None, width_px: int = 800,
                   height_px: int = 520) -> bytes:
    """:func:`sweep_figure` as PNG bytes; its tEXt chunk ``segckpt:points`` holds the number of
    points drawn (for tools and tests)."""
    figure = sweep_figure(cells, family, budget_bytes, width_px, height_px)
    points = figure.axes[0].collections[0].get_offsets()  # the scatter: the points actually drawn
    out = io.BytesIO()
    figure.savefig(out, format="png", metadata={"segckpt:points": str(len(points))})
    return out.getvalue()
