"""Sana (``SanaTransformer2DModel``): one list of linear-attention DiT blocks.

Blocks are called as ``block(hidden, attention_mask, encoder, encoder_attention_mask, timestep,
post_patch_height, post_patch_width)`` and return the hidden state alone; the two ints are the
same for every block, so the carry is the plain single-tensor one. The FFN (``GLUMBConv``) is a
clean sub-module, called on the hidden state reshaped to an image. ControlNet residuals added
between blocks are not modelled: the runner detects them and falls back to per-block.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family
from ..timesteps import scheduler_timesteps


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    inputs = {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        # the Sana pipeline passes scheduler timesteps times timestep_scale
        "timestep": scheduler_timesteps(sigmas, latents.dtype) * model.config.timestep_scale,
        "return_dict": False,
    }
    if model.config.guidance_embeds:  # Sana-Sprint checkpoints embed the guidance scale
        inputs["guidance"] = torch.full_like(sigmas, 4.5 * model.config.guidance_embeds_scale,
                                             dtype=latents.dtype)
    return inputs


SANA = register_family(
    FamilyAdapter(
        name="sana",
        model_class="SanaTransformer2DModel",
        flow_shift=FlowShift(3.0, source="Sana 1024px: DPMSolverMultistepScheduler flow_shift 3.0 "
                             "(diffusers scripts/convert_sana_to_diffusers.py; 6.0 at 4K)"),
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention="attn1"),),
        text=lambda cfg: TextSpec(cfg["caption_channels"]),
        make_inputs=_make_inputs,
        tiny_config={
            "in_channels": 32,
            "out_channels": 32,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "num_layers": 8,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 8,
            "cross_attention_dim": 16,
            "caption_channels": 32,
            "sample_size": 8,
            "patch_size": 1,
        },
        latent_channels=32,
        notes=(
            "attention boundary is the linear self-attention attn1; the cross-attention attn2 stays in the block",
            "Sana-Sprint (guidance_embeds) uses a TrigFlow/SCM objective that the flow objective does not model",
        ),
    )
)
