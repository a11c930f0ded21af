"""SD 1.x / SDXL / Kolors (``UNet2DConditionModel``): per-layer checkpointing only.

Source: ``diffusers/models/unets/unet_2d_condition.py``, ``unet_2d_blocks.py`` and
``transformers/transformer_2d.py`` (diffusers 0.42); inputs as in the SD / SDXL / Kolors pipelines.
Epsilon objective: the timestep is the DDPM step as a float (:func:`..timesteps.scheduler_timesteps`).
SDXL / Kolors (``addition_embed_type="text_time"``) also get ``text_embeds`` (pooled) and ``time_ids``
= (H, W, 0, 0, H, W) in pixels (original size, crop top-left, target size). No text mask is passed.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family
from ..timesteps import scheduler_timesteps

_VAE_SCALE = 8  # SD / SDXL / Kolors VAEs downsample by 8


def _text_spec(cfg) -> TextSpec:
    seq_dim = cfg["encoder_hid_dim"] if cfg.get("encoder_hid_dim_type") == "text_proj" else cfg["cross_attention_dim"]
    pooled = None
    if cfg.get("addition_embed_type") == "text_time":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    return TextSpec(seq_dim, pooled)


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    inputs = {
        "sample": latents,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the DDPM timestep t
        "encoder_hidden_states": text.seq.to(latents.dtype),
        "return_dict": False,
    }
    if model.config.addition_embed_type == "text_time":
        hp, wp = h * _VAE_SCALE, w * _VAE_SCALE
        time_ids = torch.tensor([[hp, wp, 0, 0, hp, wp]], dtype=latents.dtype, device=latents.device)
        inputs["added_cond_kwargs"] = {"text_embeds": text.pooled.to(latents.dtype),
                                       "time_ids": time_ids.expand(b, 6)}
    return inputs


# What the checkpoint function sees: enable_gradient_checkpointing sets it on every sub-module with
# a gradient_checkpointing attribute, and then route: every ResnetBlock2D of the down / up blocks
# (CrossAttnDownBlock2D, DownBlock2D, CrossAttnUpBlock2D, UpBlock2D) as resnet(hidden, temb) ->
# hidden; the mid block's resnets after the first the same way (mid_block.resnets[0] is always
# called directly by UNetMidBlock2DCrossAttn.forward: routed=False); not the cross-attention
# Transformer2DModel modules (the blocks call attn(...) directly) but, inside each, every
# BasicTransformerBlock as block(hidden, attention_mask, encoder_hidden_states,
# encoder_attention_mask, timestep, cross_attention_kwargs, class_labels) -> hidden. These sit in
# nested collections, so the lists are dotted paths (* = every child, [a:b] = a slice) that
# FamilyAdapter.blocks resolves (:func:`.blocks.resolve_blocks`).
# Per-block only (segmented=False, as the documents say: "SD 1.x and SDXL (UNet: per-layer
# checkpointing only; interval and stride not wired)"): consecutive resnets of a list are separated
# by un-routed work (the cross-attention Transformer2DModel, the up blocks' skip concatenation
# cat([hidden, res_hidden]), down/upsamplers), so no carry map can chain them; only the
# BasicTransformerBlock runs of one Transformer2DModel (SDXL's transformer_layers_per_block > 1)
# could be chained, which the documents do not wire. The FFN / attention boundaries (ff, attn1)
# exist only in the transformer-block lists, so *-ffn backends and attention offload are refused.
_RES = dict(carry=SINGLE, ffn=None, attention=None)


_TRANSFORMER = dict(carry=SINGLE, ffn="ff", attention="attn1")
UNET2DCONDITION = register_family(
    FamilyAdapter(
        name="unet2dcondition",
        model_class="UNet2DConditionModel",
        block_lists=(
            BlockList("down_resnets", "down_blocks.*.resnets", **_RES),
            BlockList("down_transformers", "down_blocks.*.attentions.*.transformer_blocks", **_TRANSFORMER),
            BlockList("mid_first_resnet", "mid_block.resnets[:1]", **_RES, routed=False),
            BlockList("mid_resnets", "mid_block.resnets[1:]", **_RES),
            BlockList("mid_transformers", "mid_block.attentions.*.transformer_blocks", **_TRANSFORMER),
            BlockList("up_resnets", "up_blocks.*.resnets", **_RES),
            BlockList("up_transformers", "up_blocks.*.attentions.*.transformer_blocks", **_TRANSFORMER),
        ),
        text=_text_spec,
        make_inputs=_make_inputs,
        tiny_config={  # SDXL-shaped: text_time conditioning, 2 transformer layers in the attention level
            "sample_size": 8,
            "in_channels": 4,
            "out_channels": 4,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
            "block_out_channels": (8, 16),
            "layers_per_block": 2,
            "transformer_layers_per_block": (1, 2),
            "attention_head_dim": (2, 2),
            "use_linear_projection": True,
            "norm_num_groups": 4,
            "cross_attention_dim": 32,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 32 + 6 * 8,
        },
        latent_channels=4,
        objective="epsilon",
        segmented=False,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"),
        notes=(
            "per-layer checkpointing only (documents): resnets and BasicTransformerBlocks are each "
            "checkpointed on their own; interval and stride are ignored with a warning",
            "mid_block.resnets[0] is called directly by the mid block, never through the checkpoint "
            "function",
            "default LoRA targets add the resnets' conv1/conv2 (LoCon-style) to the attention "
            "projections, so the resnet lists get LoRA gradients too",
            "epsilon prediction only: v-prediction checkpoints (SD 2.x 768) are not modelled",
        ),
    )
)
