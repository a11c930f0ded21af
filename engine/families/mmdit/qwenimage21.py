"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``): one list of single-stream blocks.

Source: ``diffusers/models/transformers/transformer_qwenimage21.py`` and
``pipelines/qwenimage21/pipeline_qwenimage21.py`` (diffusers 0.42.1). The text and the target
image share one joint sequence; the output covers it, and the prediction is its last ``H*W``
rows, as in the pipeline.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family


# As the pipeline builds them for text-to-image: AutoencoderKLQwenImage21 latents (64 channels, 16x)
# are single-frame video latents (B, C, 1, H, W), passed unpatched as (B, H*W, C) tokens; img_mask
# is the text positions (False) then one True slot per 2x2 group of target tokens; img_shapes is
# [(1, H, W)] per sample; the timestep is sigma (the pipeline passes t / 1000).
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, c, _, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"Qwen-Image 2.1 needs even latent height and width (2x2 image slots), got {h}x{w}")
    tokens = latents[:, :, 0].reshape(b, c, h * w).transpose(1, 2)  # the pipeline's _pack_latents
    slots = torch.ones(b, h * w // 4, dtype=torch.bool, device=latents.device)
    return {
        "hidden_states": tokens,
        "encoder_hidden_states": text.seq,
        "encoder_hidden_states_mask": text.mask,
        "timestep": sigmas.to(latents.dtype),  # the pipeline passes t / 1000
        "img_shapes": [[(1, h, w)]] * b,
        "img_mask": torch.cat([torch.zeros_like(text.mask), slots], dim=1),
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    b, c, _, h, w = latents.shape
    return output[0][:, -h * w:].transpose(1, 2).reshape(b, -1, 1, h, w)


# Under gradient checkpointing the loop calls every block as block(joint, modulation, rotary_emb,
# attention_mask, modulation_mask, layer_cache, kv_cache_mode, cache_write_slice, segments,
# key_valid) -> joint. modulation is ONE tensor shared by all blocks (each block chunks it itself)
# and without a KV cache (training) layer_cache is None for every block, so SINGLE. (With a KV
# cache, inference only, layer_cache differs per block and the runner would fall back.) No
# attention boundary, as the documents say ("attention offload unsupported"): its attention
# processor takes the KV-cache and block-causal segment arguments.
QWENIMAGE21 = register_family(
    FamilyAdapter(
        name="qwenimage21",
        model_class="QwenImage21Transformer2DModel",
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="img_mlp", attention=None),),
        text=lambda cfg: TextSpec(cfg["context_in_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "patch_size": 1,
            "in_channels": 64,
            "out_channels": 64,
            "num_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "context_in_dim": 32,
            "mlp_ratio": 3,
            "axes_dims_rope": (4, 6, 6),  # sums to the head dim
        },
        latent_channels=64,
        latent_multiple=2,  # one token per latent cell, but 2x2 image slots: even sides
        video_latents=True,
        notes=(
            "attention offload unsupported (documents): no attention boundary declared",
            "latents are single-frame video latents (B, C, 1, H, W) from AutoencoderKLQwenImage21 (64 channels)",
            "text-to-image only: condition images (editing) are not built here; no KV cache in training",
            "the text mask is passed as encoder_hidden_states_mask (padded text keys are dropped)",
        ),
    )
)
