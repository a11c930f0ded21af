"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``): one list of joint (MMDiT) blocks.

The blocks are called as ``block(hidden, encoder, temb, joint_attention_kwargs)`` and return
``(encoder, hidden)``. The last block is ``context_pre_only`` and returns ``(None, hidden)``; that
is harmless to the carry map, which is only applied *between* blocks of a segment, and the loop
itself only reads ``hidden`` after the last block. ControlNet residuals added between blocks are
not modelled: the runner detects them and falls back to per-block for the list.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import SD3 as SD3_LATENTS
from ..conditioning import TextEncoders
from ..lazy import torch
from ..position_tables import pos_embed_grid
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# block(hidden, encoder, temb, joint_attention_kwargs) -> (encoder, hidden)
_CARRY = Carry(((0, 1), (1, 0)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq,
        "pooled_projections": text.pooled,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the SD3 pipelines pass scheduler timesteps
        "return_dict": False,
    }


SD3 = register_family(
    FamilyAdapter(
        name="sd3",
        model_class="SD3Transformer2DModel",
        flow_shift=FlowShift(3.0, mu_rule="stable_diffusion_3.pipeline_stable_diffusion_3:calculate_shift",
                             source="stabilityai/stable-diffusion-3.5-large scheduler_config.json"),
        block_lists=(BlockList("joint", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"], cfg["pooled_projection_dim"]),
        make_inputs=_make_inputs,
        tiny_config={
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 8,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "caption_projection_dim": 16,  # must equal heads x head_dim
            "pooled_projection_dim": 32,
            "pos_embed_max_size": 16,
            "dual_attention_layers": (0, 1),  # SD3.5-style blocks too
            "qk_norm": "rms_norm",
        },
        latent_channels=16,
        limits=pos_embed_grid,
        comfy_latents=SD3_LATENTS,
        # CLIP-L and CLIP-G (pooled, and penultimate states before the T5 tokens), T5-XXL
        text_encoders=TextEncoders("t5", pooled=("clip", "clip"), clip_states=True, max_length=256),
        notes=(
            "the last block is context_pre_only (returns no text stream); the carry map is unaffected",
            "FFN boundary is the image stream's ff; the text stream's ff_context stays in the block",
        ),
    )
)
