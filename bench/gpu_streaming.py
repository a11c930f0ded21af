"""Part (f) of the GPU check (issues 21 and 36): weight streaming on a full-size Flux.1-dev through the
trainer, bf16 and int8-torchao bases, with the pinned arena of each streamed cell. Called by
``bench/gpu_check.py``; its smoke run (tiny Flux on the CPU) is part of ``gpu_check.sh --smoke``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import diffusers
import torch
from gpu_sweep import default_dtype, mem_unit

from segmented_checkpointing.engine.config import MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.measure.planner import PlannerError
from segmented_checkpointing.engine.measure.planning import plan_for_budget
from segmented_checkpointing.engine.measure.probe import probe
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.model.bundle import ModelBundle, tiny_vae_config
from segmented_checkpointing.engine.model.text_encoders import DeterministicTextEmbedder

FAMILY = get_family("flux")
PREDICT_ONLY = MeasureConfig.create(timing_steps=0)
STREAM_BASES = ("bf16", "int8-torchao")
STREAM_BUDGETS_GIB = (12, 16, 24)


def streaming_check(sizes, device: torch.device, log, bases: tuple[str, ...] = STREAM_BASES) -> list[str]:
    """Weight streaming on a full-size Flux.1-dev at ``sizes.preflight_resolution`` px, bf16 and
    int8 bases, through the trainer (the streamed blocks never reach the device whole): resident
    per-block; stream every block at interval 1 and at interval 2 stride 4; the planner's choice
    under 12, 16 and 24 GiB (on the CPU smoke: 50, 70 and 90% of the resident per-block peak).
    Cells ``sec/step / peak``, weight H2D per step, stall share, the pinned arena's allocated / used
    bytes; ratios to resident per-block. ``sizes``: part of ``gpu_check``'s ``Sizes`` (``full``,
    ``preflight_resolution``, ``warmup``, ``steps``)."""
    from PIL import Image

    unit, scale = mem_unit(device)
    columns = [("resident per-block", CheckpointSchedule()),
               ("stream all, interval 1", CheckpointSchedule(weight_offload="stream")),
               ("stream all, interval 2 stride 4", CheckpointSchedule(
                   gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4, weight_offload="stream"))]
    r = sizes.preflight_resolution
    rows = [f"| base | column | schedule | sec/step / peak {unit} | weight H2D {unit}/step | stall | arena {unit} "
            "allocated / used | time / peak vs resident per-block |", "|---|---|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-check-") as folder:
        data = Path(folder) / "data"
        data.mkdir()
        for i in range(2):
            Image.new("RGB", (r, r), (60 * i, 120, 200)).save(data / f"img{i}.png")
        for base in bases:
            torch.manual_seed(0)
            with default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32):  # on the host
                transformer = diffusers.FluxTransformer2DModel(**{**sizes.full, "guidance_embeds": False})
            vae = diffusers.AutoencoderKL(**tiny_vae_config(FAMILY.latent_channels))
            bundle = ModelBundle(FAMILY, transformer.eval(), vae.eval(),
                                 DeterministicTextEmbedder(FAMILY.text(transformer.config)), "random-init Flux.1-dev")
            config = TrainConfig.create(data=str(data), resolution=r, batch_size=1, device=device.type,
                                        base_model_precision=base, lora_rank=16, lora_alpha=16,
                                        output=str(Path(folder) / "out"), guardrails=None)
            cells = [(name, schedule) for name, schedule in columns]
            reference = None
            with RunWorkspace(config, bundle) as workspace:
                measured = []
                for name, schedule in cells:
                    measured.append((name, schedule, _stream_cell(workspace, schedule, sizes)))
                    reference = reference or (measured[0][2] if "error" not in measured[0][2] else None)
                    log(f"  {base} | {name}: {_stream_text(measured[-1][2], scale)}, arena "
                        f"{_arena_text(measured[-1][2], scale)}")
                budgets = ([g * 2**30 for g in STREAM_BUDGETS_GIB] if device.type == "cuda" else
                           [int(f * reference["peak"]) for f in (0.5, 0.7, 0.9)] if reference else [])
                measured_probe = probe(workspace) if budgets else None  # one for every budget
                for budget in budgets:
                    label = f"planner, {budget / scale:.4g} {unit}"
                    try:
                        chosen = plan_for_budget(RunWorkspace(config, bundle), PREDICT_ONLY, budget,
                                                 probe_=measured_probe).chosen.schedule
                    except PlannerError as exc:
                        measured.append((label, None, {"error": str(exc)[:160]}))
                        continue
                    measured.append((label, chosen, _stream_cell(workspace, chosen, sizes)))
                    log(f"  {base} | {label}: {chosen.mode} {_stream_text(measured[-1][2], scale)}")
            for name, schedule, cell in measured:
                if schedule is None:  # the planner found nothing that fits
                    rows.append(f"| {base} | {name} | {cell['error']} | | | | | |")
                    continue
                ok = cell and "error" not in cell and reference and "error" not in reference
                ratio = f"{cell['sec'] / reference['sec']:.2f}x / {cell['peak'] / reference['peak']:.2f}x" if ok else "-"
                text = _stream_text(cell, scale)
                h2d = f"{cell['h2d'] / scale:.3f}" if cell and "error" not in cell else "-"
                stall = f"{cell['stall']:.0%}" if cell and "error" not in cell else "-"
                rows.append(f"| {base} | {name} | {schedule.mode} | {text} | {h2d} | {stall} | "
                            f"{_arena_text(cell, scale)} | {ratio} |")
            del bundle, transformer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows += ["", "Target (issue 21): peak <= 12 GiB at <= 1.30x the resident per-block time "
             "(RamTorch in ai-toolkit: about half the VRAM at 1.34x)."]
    return rows


def _stream_cell(workspace: RunWorkspace, schedule: CheckpointSchedule, sizes) -> dict | None:
    """One trainer run: median sec/step and weight figures after warm-up, device peak (None: failed)."""
    try:
        result = workspace.run(schedule, sizes.warmup, sizes.steps)
    except Exception as exc:  # noqa: BLE001 - a cell never stops the check (OOM on a small budget)
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    after = result.history[sizes.warmup:]
    middle = sorted(after, key=lambda h: h["seconds"])[len(after) // 2]
    return {"sec": result.report["totals"]["sec_per_step"], "peak": peak_after_warmup(result, sizes.warmup),
            "h2d": middle["weight_h2d_bytes"], "stall": middle["weight_stall_s"] / middle["seconds"],
            "arena": result.report["memory"]["host_arena"]}


def _arena_text(cell: dict | None, scale: int) -> str:
    """The host arena of a streamed cell: ``allocated / used (ratio, chunks)``; ``-`` without one."""
    arena = (cell or {}).get("arena") or {}
    if not arena.get("used_bytes"):
        return "-"
    allocated, used = arena["allocated_bytes"], arena["used_bytes"]
    return f"{allocated / scale:.3f} / {used / scale:.3f} ({allocated / used:.3f}x, {arena['chunks']} chunks)"


def _stream_text(cell: dict | None, scale: int) -> str:
    if not cell or "error" in cell:
        return "failed" if not cell else ("OOM" if "memory" in cell["error"].lower() else "failed")
    return f"{cell['sec']:.3f} / {cell['peak'] / scale:.3f}"
