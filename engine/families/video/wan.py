"""Wan 2.1 / 2.2 (``WanTransformer3DModel``): one list of DiT blocks over video latents.

Blocks are called as ``block(hidden, encoder, timestep_proj, rotary_emb)`` and return the hidden
state alone. Latents are ``(B, C, F, H, W)``; an image is a single frame (F = 1). The Wan
pipelines zero the text embeddings past each prompt's length instead of passing a mask; the
adapter does the same with the batch's mask.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import WAN21, TextEncoders
from ..frames import WAN_VAE
from ..lazy import torch
from ..position_tables import wan_rope
from ..registry import register_family
from ..timesteps import scheduler_timesteps


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq * text.mask.unsqueeze(-1).to(text.seq.dtype),
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the Wan pipelines pass scheduler timesteps
        "return_dict": False,
    }


WAN = register_family(
    FamilyAdapter(
        name="wan",
        model_class="WanTransformer3DModel",
        flow_shift=FlowShift(3.0, source="Wan2.1 T2V Diffusers: UniPCMultistepScheduler flow_shift 3.0 (diffusers "
                             "scripts/convert_wan_to_diffusers.py; WanPipeline's docs: 5.0 at 720p)"),
        block_lists=(BlockList("blocks", "blocks", SINGLE, ffn="ffn", attention="attn1"),),
        text=lambda cfg: TextSpec(cfg["text_dim"]),
        make_inputs=_make_inputs,
        tiny_config={
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 32,
            "freq_dim": 32,
            "ffn_dim": 32,
            "num_layers": 8,
            "rope_max_seq_len": 32,
        },
        latent_channels=16,
        limits=wan_rope,
        comfy_latents=WAN21,
        text_encoders=TextEncoders("t5", max_length=512),  # UMT5-XXL
        video_latents=True,
        frames=WAN_VAE,
        notes=(
            "latent_channels 16 is the Wan 2.1 VAE (Wan 2.2 TI2V-5B uses a 48-channel VAE)",
            "image-to-video variants (image_dim set) need encoder_hidden_states_image: not built here",
            "attention boundary is the self-attention attn1; the cross-attention attn2 stays in the block",
        ),
    )
)
