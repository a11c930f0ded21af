"""Stable Cascade stage C (``StableCascadeUNet``): the down and up sequences of Res / Timestep /
Attention micro-blocks. Per-block checkpointing only (an engine limit: see the notes).

Source: ``diffusers/models/unets/unet_stable_cascade.py`` and
``diffusers/pipelines/stable_cascade/pipeline_stable_cascade_prior.py`` (diffusers 0.42).
"""

from __future__ import annotations

import math

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family
from ..timesteps import alphas_cumprod, ddpm_timesteps

_S = 0.008  # offset of the cosine schedule (DDPMWuerstchenScheduler / the prior pipeline)


def _timestep_ratio(sigmas: torch.Tensor) -> torch.Tensor:
    """The prior pipeline's ``get_timestep_ratio_conditioning`` at the DDPM step of ``sigmas``
    (:func:`..timesteps.ddpm_timesteps`): stage C's cosine-schedule ratio for the DDPM noise level."""
    var = alphas_cumprod()[ddpm_timesteps(sigmas.double())].clamp(0, 1)
    min_var = math.cos(_S / (1 + _S) * math.pi * 0.5) ** 2
    return ((var * min_var) ** 0.5).acos() / (math.pi * 0.5) * (1 + _S) - _S


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    cfg = model.config
    b, device, dtype = latents.shape[0], latents.device, latents.dtype
    # prior pipeline: clip_text (B, L, 1280) and clip_text_pooled (B, 1, 1280) from the CLIP text
    # encoder, clip_img zeros (B, 1, 768) when no image prompt is given
    inputs = {
        "sample": latents,
        "timestep_ratio": _timestep_ratio(sigmas.cpu()).to(device, dtype),
        "clip_text_pooled": text.pooled.to(device, dtype).unsqueeze(1),
        "return_dict": False,
    }
    if cfg.clip_text_in_channels is not None and cfg.clip_image_in_channels is not None:
        inputs["clip_text"] = text.seq.to(device, dtype)
        inputs["clip_img"] = torch.zeros(b, 1, cfg.clip_image_in_channels, device=device, dtype=dtype)
    return inputs


# The lists are the flattened micro-blocks of all down / up levels, in forward order. The UNet's
# _down_encode / _up_decode call each through the checkpoint function with arguments that depend
# on its type: SDCascadeResBlock as block(x) (down) or block(x, skip) (up; skip is the level output
# for the first block of every up level but the first, else None), SDCascadeTimestepBlock as
# block(x, r_embed), SDCascadeAttnBlock as block(x, clip); each returns x alone. A segment runs its
# blocks with the first block's non-carried arguments, so [Res, Timestep] would call the Timestep
# block without r_embed (a TypeError) and [Timestep, Attn] would hand r_embed to the Attention block
# as its kv; between up levels the loop also interpolates x and runs the upscaler (un-routed).
# Hence segmented=False (though the documents place interval and stride on this sequence) until
# the engine can build per-block arguments. With *_blocks_repeat_mappers > 1 (stage B) each
# micro-block runs several times per forward, each run its own checkpoint call. No FFN /
# attention boundary: only the Attention blocks have an attention and only the Res blocks a
# channelwise MLP, so *-ffn backends and attention offload are refused.
STABLECASCADE = register_family(
    FamilyAdapter(
        name="stablecascade",
        model_class="StableCascadeUNet",
        block_lists=(
            BlockList("down", "down_blocks.*", SINGLE, ffn=None, attention=None),
            BlockList("up", "up_blocks.*", SINGLE, ffn=None, attention=None),
        ),
        text=lambda cfg: TextSpec(cfg["clip_text_in_channels"] or cfg["clip_text_pooled_in_channels"],
                                  cfg["clip_text_pooled_in_channels"]),
        make_inputs=_make_inputs,
        tiny_config={  # stage C shaped (switch_level False: no spatial change between levels)
            "in_channels": 16,
            "out_channels": 16,
            "timestep_ratio_embedding_dim": 16,
            "patch_size": 1,
            "conditioning_dim": 32,
            "block_out_channels": (16, 32),
            "num_attention_heads": (2, 2),
            "down_num_layers_per_block": (2, 2),
            "up_num_layers_per_block": (2, 2),
            "clip_text_in_channels": 32,
            "clip_text_pooled_in_channels": 32,
            "clip_image_in_channels": 16,
            "clip_seq": 4,
            "dropout": (0.0, 0.0),
            "switch_level": (False,),
        },
        latent_channels=16,
        objective="epsilon",
        segmented=False,
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "channelwise.0", "channelwise.4"),
        notes=(
            "per-block only (engine limit): Res / Timestep / Attention micro-blocks take different "
            "non-carried arguments (none / r_embed / clip), which a carry map cannot supply; interval "
            "and stride are ignored with a warning",
            "latent_channels 16: stage C's EfficientNet latents; stage B (effnet / pixels conditioning) "
            "is not built here",
            "default LoRA targets add the Res blocks' MLP linears (channelwise.0/.4) to the attention "
            "projections (the official stage C LoRA recipe is attention only): with attention-only LoRA the "
            "micro-blocks before the first Attention block get no gradient, so checkpointing them recomputes "
            "nothing and only costs the call",
            "the engine's epsilon noise level (DDPM scaled-linear) is passed as the matching cosine "
            "timestep_ratio, as the prior pipeline does for non-Wuerstchen schedulers",
        ),
    )
)
