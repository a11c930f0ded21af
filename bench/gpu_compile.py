"""Part (h) of the GPU check (``bench/gpu_check.py``): what saved attention outputs and per-block
compile cost and save, on a full-size Flux.1-dev.

The architecture of FLUX.1-dev (random init, bf16 base: 19 double and 38 single blocks, 24 heads x
128, text width 4096, pooled 768, guidance embeds) at 1024 and 2048 px (latents ``(1, 16, 128, 128)``
and ``(1, 16, 256, 256)``: 4096 and 16384 image tokens after the 2x2 packing), 512 text tokens,
rank-16 LoRA, batch 1, trained through the trainer on prepared latents (synthetic: memory and time
depend on the shapes). Rows: per-block and interval 2 stride 4, each eager, with
``gradient_checkpointing_save_attention``, with ``compile_blocks`` and with both; plus no
checkpointing. Cells ``sec/step / peak`` and the step-time ratio to no checkpointing.

Targets (issue 25): per-block with saved attention <= 1.25x the no-checkpoint step at 1024 px (1.42x
measured before on an H200) within the per-block peak + 2.5 GiB; compiled >= 1.25x faster than eager
at the same schedule, peak within +5%, 0 recompiles after warm-up.

``--smoke`` (CPU, CI): the tiny Flux preset at 64 and 128 px, eager and saved attention only
(inductor's compile would dominate a smoke run; ``tests/core/test_compile_blocks.py`` covers it).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import diffusers
import torch
from gpu_video import random_bundle, run_cell  # noqa: E402 (bench/ is on the path: gpu_check.py)

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.data.comfy_data import PreparedData
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup

FAMILY = get_family("flux")
FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
            "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}
"""``black-forest-labs/FLUX.1-dev`` ``transformer/config.json``."""
SCHEDULES = [("per-block", CheckpointSchedule()),
             ("interval 2 stride 4", CheckpointSchedule(gradient_checkpointing_interval=2,
                                                        gradient_checkpointing_segment_stride=4))]
VARIANTS = [("eager", False, False), ("save_attention", True, False), ("compiled", False, True), ("both", True, True)]


def sizes(smoke: bool) -> dict:
    """The check's config, pixel sides, text tokens, steps and variants."""
    if smoke:
        return {"config": FAMILY.tiny_config, "pixels": (64, 128), "text": 8, "warmup": 1, "steps": 1, "base": "auto",
                "variants": VARIANTS[:2]}
    return {"config": FLUX_DEV, "pixels": (1024, 2048), "text": 512, "warmup": 2, "steps": 3, "base": "bf16",
            "variants": VARIANTS}


def latents(config: dict, side: int, text_tokens: int) -> PreparedData:
    """One sample of synthetic latents ``(1, 16, side/8, side/8)`` and text ``(1, L, 4096)`` (+ pooled)."""
    g = torch.Generator().manual_seed(0)
    shape = (FAMILY.latent_channels, side // 8, side // 8)
    cache = {"latents": torch.randn(1, *shape, generator=g),
             "text_seq": torch.randn(1, text_tokens, config["joint_attention_dim"], generator=g),
             "text_mask": torch.ones(1, text_tokens, dtype=torch.bool),
             "text_pooled": torch.randn(1, config["pooled_projection_dim"], generator=g)}
    summary = {"source": "synthetic Flux latents", "images": 1, "images_per_epoch": 1, "latent_shape": list(shape),
               "latent_format": "standard normal", "conditioning": "random", "text_tokens": text_tokens,
               "text_width": config["joint_attention_dim"], "pooled_width": config["pooled_projection_dim"]}
    return PreparedData(FAMILY.name, cache, summary)


def _cell(workspace: RunWorkspace, schedule: CheckpointSchedule, compiled: bool, s: dict) -> tuple[float, int] | str:
    """``(sec/step, peak bytes)`` of one trainer run, or ``OOM`` / ``failed (...)``."""
    result = run_cell(workspace, schedule, s["warmup"], s["steps"], compile_blocks=compiled)
    if isinstance(result, str):
        return result
    return result.report["totals"]["sec_per_step"], peak_after_warmup(result, s["warmup"])


def _text(cell: tuple[float, int] | str, reference: tuple[float, int] | str, scale: int) -> str:
    if isinstance(cell, str):
        return cell
    ratio = f" ({cell[0] / reference[0]:.2f}x)" if not isinstance(reference, str) else ""
    return f"{cell[0]:.3f} / {cell[1] / scale:.3f}{ratio}"


def compile_check(smoke: bool, device: torch.device, budget_s: float, log) -> list[str]:
    """The rows of part (h): per pixel side, one row per schedule and variant (``not run`` past ``budget_s``)."""
    s = sizes(smoke)
    unit, scale = ("GiB", 2**30) if device.type == "cuda" else ("MiB", 2**20)
    bundle = random_bundle(FAMILY, diffusers.FluxTransformer2DModel, s["config"], device, "random-init Flux.1-dev")
    rows = [f"sec/step / peak {unit} (ratio to no checkpointing)", "",
            "| px | schedule | " + " | ".join(name for name, _, _ in s["variants"]) + " |",
            "|---|---|" + "---:|" * len(s["variants"])]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-compile-") as folder:
        for side in s["pixels"]:
            config = TrainConfig.create(resolution=side, device=device.type, base_model_precision=s["base"],
                                        lora_rank=16, lora_alpha=16, output=str(Path(folder) / "out"), guardrails=None)
            with RunWorkspace(config, bundle, prepared=latents(s["config"], side, s["text"])) as workspace:
                reference = _cell(workspace, CheckpointSchedule(gradient_checkpointing=False), False, s)
                rows.append(f"| {side} | none | {_text(reference, reference, scale)} |" + " |" * (len(s["variants"]) - 1))
                for name, schedule in SCHEDULES:
                    cells = []
                    for variant, save, compiled in s["variants"]:
                        if time.monotonic() - started > budget_s:
                            cells.append("not run")
                            continue
                        chosen = schedule.replace(gradient_checkpointing_save_attention=save)
                        cells.append(_text(_cell(workspace, chosen, compiled, s), reference, scale))
                        log(f"  {side} px | {name} | {variant}: {cells[-1]}")
                    rows.append(f"| {side} | {name} | " + " | ".join(cells) + " |")
    return rows
