"""Nodes that show a training run: the loss graph (IMAGE) and the run report (text + plan)."""

from __future__ import annotations

import json

import torch

from ..engine.plots import loss_curve_rgb
from .training_nodes import CATEGORY, RUN


class LossGraph:
    """The loss per optimizer step as an IMAGE (``(1, H, W, 3)`` float in [0, 1])."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "plot", ("IMAGE",), ("image",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"run": (RUN, {"tooltip": "From Train LoRA."})}}

    def plot(self, run):
        result = run["result"]
        rgb = loss_curve_rgb(result.history, f"{result.plan.family} - {result.config.schedule.mode}")
        return (torch.from_numpy(rgb).float().div(255.0).unsqueeze(0),)


class RunReport:
    """sec/step, peak memory and the effective per-block plan, as text."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES, OUTPUT_NODE = CATEGORY, "report", ("STRING",), ("report",), True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"run": (RUN, {"tooltip": "From Train LoRA."})}}

    def report(self, run):
        result = run["result"]
        totals = result.report["totals"]
        sec = totals["sec_per_step"]
        lines = [
            f"{totals['steps']} steps{' (interrupted, resumable)' if result.interrupted else ''}, "
            f"final loss {totals['final_loss']:.4f}",
            f"{sec:.3f} sec/step (median after warm-up)" if sec is not None else "sec/step: too few steps",
            f"peak {totals['peak_mib']:.1f} MiB ({totals['peak_scope']})",
            result.plan.render(),
            f"report: {result.report_path}",
        ]
        text = "\n".join(lines)
        return {"ui": {"text": [text], "plan": [json.dumps(result.plan.to_dict())]}, "result": (text,)}
