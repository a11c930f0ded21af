"""Part (g) of the GPU check (``bench/gpu_check.py``): video LoRA training on a full-size Wan 2.1 14B.

The architecture of Wan2.1-T2V-14B (random init, bf16 base: 40 blocks, 40 heads x 128, FFN 13824,
T5 width 4096, frequency dim 256, 16 latent channels, patch (1, 2, 2)) at 480x832 px with 33 and 81
pixel frames: latents ``(1, 16, 9, 60, 104)`` and ``(1, 16, 21, 60, 104)`` (Wan's VAE: 4x temporal,
8x spatial; 14040 and 32760 tokens), 512 text tokens, rank-16 LoRA, batch 1, trained through the
trainer on prepared latents (synthetic; memory and time depend on the shapes). Columns: none,
per-block (``layer``), interval 2 stride 4, per-block ``unsloth`` and per-block with every block's
weights streamed (``layer-stream``); cells ``sec/step / peak`` (median after warm-up / the largest
device peak after warm-up, weights included).

The anchor to beat (SimpleTuner's documentation): Wan 2.1 14B with RamTorch and per-block
checkpointing, 16.28 GiB at 7.16 s/step on an H100; its interval 2 stride 4 row ran out of memory.

``--smoke`` (CPU, CI): the tiny Wan preset at 64x112 px with 5 and 9 frames, a few seconds.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import diffusers
import torch

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.data.comfy_data import PreparedData
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.families.limits import token_count
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.model.bundle import ModelBundle, tiny_vae
from segmented_checkpointing.engine.model.text_encoders import DeterministicTextEmbedder

FAMILY = get_family("wan")
WAN_14B = {"patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
           "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
           "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
"""``Wan-AI/Wan2.1-T2V-14B-Diffusers`` ``transformer/config.json``."""
COLUMNS = [("none", CheckpointSchedule(gradient_checkpointing=False)),
           ("per-block", CheckpointSchedule()),
           ("interval 2 stride 4", CheckpointSchedule(gradient_checkpointing_interval=2,
                                                      gradient_checkpointing_segment_stride=4)),
           ("unsloth", CheckpointSchedule(gradient_checkpointing_backend="unsloth")),
           ("per-block, weights streamed", CheckpointSchedule(weight_offload="stream"))]
ANCHOR = ("Anchor to beat (SimpleTuner docs): Wan 2.1 14B with RamTorch and per-block checkpointing, "
          "16.28 GiB at 7.16 s/step on an H100; its interval 2 stride 4 row out of memory.")


def sizes(smoke: bool) -> dict:
    """The check's config, pixel size (height, width), frame counts, text tokens and steps."""
    if smoke:
        return {"config": FAMILY.tiny_config, "pixels": (64, 112), "frames": (5, 9), "text": 8, "warmup": 1,
                "steps": 1, "base": "auto"}
    return {"config": WAN_14B, "pixels": (480, 832), "frames": (33, 81), "text": 512, "warmup": 1, "steps": 2,
            "base": "bf16"}


def clips(config: dict, frames: int, pixels: tuple[int, int], text_tokens: int) -> PreparedData:
    """Synthetic prepared data: one sample of latents ``(1, 16, F', H/8, W/8)`` and text ``(1, L, text_dim)``."""
    g = torch.Generator().manual_seed(0)
    shape = (FAMILY.latent_channels, FAMILY.frames.latent_frames(frames), pixels[0] // 8, pixels[1] // 8)
    cache = {"latents": torch.randn(1, *shape, generator=g),
             "text_seq": torch.randn(1, text_tokens, config["text_dim"], generator=g),
             "text_mask": torch.ones(1, text_tokens, dtype=torch.bool)}
    summary = {"source": "synthetic Wan clip latents", "images": 1, "images_per_epoch": 1, "latent_shape": list(shape),
               "latent_format": "standard normal", "conditioning": "random", "text_tokens": text_tokens,
               "text_width": config["text_dim"], "pooled_width": 0}
    return PreparedData(FAMILY.name, cache, summary)


def run_cell(workspace: RunWorkspace, schedule: CheckpointSchedule, warmup: int, steps: int, **changes):
    """One trainer run of ``schedule`` (``changes``: other settings, e.g. ``compile_blocks``): its
    result, or ``OOM`` / ``failed (...)`` (a cell never stops the check)."""
    try:
        return workspace.run(schedule, warmup, steps, **changes)
    except Exception as exc:  # noqa: BLE001 - a cell never stops the check
        return "OOM" if "out of memory" in str(exc).lower() else f"failed ({type(exc).__name__})"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def random_bundle(family, model_cls: type, config: dict, device: torch.device, source: str) -> ModelBundle:
    """A random-init model of ``config`` (bf16 on CUDA, built in host memory) with the family's tiny
    VAE and the deterministic text embedder."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        transformer = model_cls(**config)
    finally:
        torch.set_default_dtype(old)
    return ModelBundle(family, transformer.eval(), tiny_vae(family).eval(),
                       DeterministicTextEmbedder(family.text(transformer.config)), source)


def _cell(workspace: RunWorkspace, schedule: CheckpointSchedule, warmup: int, steps: int, scale: int) -> str:
    """``sec/step / peak`` of one trainer run, ``OOM`` or ``failed``."""
    result = run_cell(workspace, schedule, warmup, steps)
    if isinstance(result, str):
        return result
    return f"{result.report['totals']['sec_per_step']:.3f} / {peak_after_warmup(result, warmup) / scale:.3f}"


def video_check(smoke: bool, device: torch.device, budget_s: float, log) -> list[str]:
    """The rows of part (g): one per frame count, one cell per column (``not run`` past ``budget_s``)."""
    s = sizes(smoke)
    unit, scale = ("GiB", 2**30) if device.type == "cuda" else ("MiB", 2**20)
    bundle = random_bundle(FAMILY, diffusers.WanTransformer3DModel, s["config"], device, "random-init Wan 2.1 14B")
    transformer = bundle.transformer
    head = "| frames (latent) | tokens | " + " | ".join(name for name, _ in COLUMNS) + " |"
    rows = [f"sec/step / peak {unit}", "", head, "|---|---:|" + "---:|" * len(COLUMNS)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="segckpt-gpu-video-") as folder:
        for frames in s["frames"]:
            data = clips(s["config"], frames, s["pixels"], s["text"])
            shape = tuple(data.cache["latents"].shape[1:])
            config = TrainConfig.create(resolution=max(s["pixels"]), device=device.type, base_model_precision=s["base"],
                                        lora_rank=16, lora_alpha=16, num_frames=frames,
                                        output=str(Path(folder) / "out"), guardrails=None)
            cells = []
            with RunWorkspace(config, bundle, prepared=data) as workspace:
                for name, schedule in COLUMNS:
                    if time.monotonic() - started > budget_s:
                        cells.append("not run")
                        continue
                    cells.append(_cell(workspace, schedule, s["warmup"], s["steps"], scale))
                    log(f"  {frames} frames | {name}: {cells[-1]}")
            tokens = token_count(FAMILY, dict(transformer.config), shape)
            rows.append(f"| {frames} ({shape[1]}) | {tokens} | " + " | ".join(cells) + " |")
    return rows + ["", ANCHOR]
