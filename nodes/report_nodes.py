"""Nodes that show a training run: the loss graph (IMAGE) and the run report (text + plan)."""

from __future__ import annotations

import io as bytes_io
import json
from pathlib import Path

import torch
from PIL import Image

from ..engine import api
from .environment import current_host, public_errors
from .messages import node_words
from .payloads import CATEGORY, Sockets
from .v3 import io


class LossGraph(io.ComfyNode):
    """The loss per optimizer step and beneath it the loss by noise level (report.json's
    ``loss_by_noise_level``: mean unweighted loss and sample count per sigma bin) as an IMAGE
    (``(1, H, W, 3)`` float in [0, 1]), also saved as ``loss.png`` in the run folder and shown on the node."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptLossGraph", display_name="Loss Graph", category=CATEGORY, is_output_node=True,
                         inputs=[Sockets.run.Input("run", tooltip="From Train LoRA.")],
                         outputs=[io.Image.Output(display_name="image")])

    @classmethod
    @public_errors
    def execute(cls, run):
        result = run
        rgb = api.loss_curve_rgb(result.history, f"{result.plan.family} - {result.plan.mode}",
                                 noise_levels=result.report.get("loss_by_noise_level"))
        run_dir = Path(result.config.outputs.output)
        png = bytes_io.BytesIO()
        Image.fromarray(rgb).save(png, format="PNG")
        api.atomic_write_bytes(run_dir / "loss.png", png.getvalue())
        output_dir = current_host().output_dir.resolve()
        shown = []
        if output_dir in run_dir.resolve().parents:
            subfolder = run_dir.resolve().relative_to(output_dir).as_posix()
            shown = [{"filename": "loss.png", "subfolder": subfolder, "type": "output"}]
        image = torch.from_numpy(rgb).float().div(255.0).unsqueeze(0)
        return io.NodeOutput(image, ui={"images": shown})


class RunReport(io.ComfyNode):
    """sec/step, peak memory and the effective per-block plan, as text."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptRunReport", display_name="Run Report", category=CATEGORY, is_output_node=True,
                         inputs=[Sockets.run.Input("run", tooltip="From Train LoRA.")],
                         outputs=[io.String.Output(display_name="report")])

    @classmethod
    @public_errors
    def execute(cls, run):
        result = run
        totals = result.report["totals"]
        sec = totals["sec_per_step"]
        report = result.report
        resumed = ""
        if result.resumed_at:
            resumed = (f" ({result.trained_steps} trained in this run, resumed at step {result.resumed_at})"
                       if result.trained_steps else
                       f" (0 trained in this run: it resumed at step {result.resumed_at} of {result.config.steps}, "
                       "nothing left; raise steps to continue it; the LoRA is unchanged)")
        lines = [
            f"{totals['steps']} steps{resumed}{' (interrupted, resumable)' if result.interrupted else ''}, "
            f"final loss {totals['final_loss']:.4f}",
            f"{sec:.3f} sec/step (median after warm-up)" if sec is not None else "sec/step: too few steps",
            f"peak {totals['peak_mib']:.1f} MiB ({totals['peak_scope']})",
            result.plan.render(),
        ]
        if report.get("preflight"):
            verdict = report["preflight"]
            lines.append(f"pre-flight: {verdict['schedule']} {'fits' if verdict['fits'] else 'did NOT fit'} "
                         f"{verdict['budget_bytes'] / 2**30:.4g} GiB: " + ", ".join(
                             f"{p['phase']} {'ok' if p['fits'] else 'NO'}" for p in verdict["phases"]))
        lines += [f"step {s['step']}: out of memory under {s['from']}: switched to {s['to']}"
                  for s in report.get("schedule_switches", [])]
        lines += [f"watchdog: {w['message']}" for w in report.get("watchdog", [])]
        if report.get("receipt"):
            lines.append(api.render_receipt(report["receipt"]))
        lines.append(f"report: {current_host().public(str(result.report_path))}")
        text = current_host().public(node_words("\n".join(lines)))
        return io.NodeOutput(text, ui={"text": [text], "plan": [json.dumps(result.plan.to_dict())]})
