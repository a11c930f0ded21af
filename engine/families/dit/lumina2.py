"""Lumina-Image 2.0 (``Lumina2Transformer2DModel``): two refiner lists, then the joint list.

Conventions (``pipeline_lumina2.py``): time runs the other way, ``t = 1 - sigma``, and the model
predicts ``x0 - noise``, so :func:`_read_output` negates it to give the flow velocity
``noise - x0``. The text mask must mark each prompt's real tokens as a prefix (the RoPE ids are
built from the mask's sum).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import FLUX, TextEncoders
from ..lazy import torch
from ..position_tables import axes_lens
from ..registry import register_family


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "hidden_states": latents,
        "timestep": 1 - sigmas.to(latents.dtype),
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return -output[0]


# The model's loops call context_refiner blocks as block(cap, mask, cap_rope) and noise_refiner
# blocks as block(hidden, None, img_rope, temb) directly, never through the checkpoint function
# (routed=False: no schedule applies, the plan says so). Only layers (block(joint, mask, rope,
# temb)) is routed. Every block returns the hidden state alone.
def _blocks(name: str, routed: bool = True) -> BlockList:
    return BlockList(name, name, SINGLE, ffn="feed_forward", attention="attn", routed=routed)


LUMINA2 = register_family(
    FamilyAdapter(
        name="lumina2",
        model_class="Lumina2Transformer2DModel",
        flow_shift=FlowShift(6.0, mu_rule="lumina2.pipeline_lumina2:calculate_shift",
                             source="Alpha-VLLM/Lumina-Image-2.0: shift 6.0 (ComfyUI's Lumina2 model sampling)"),
        block_lists=(_blocks("context_refiner", routed=False), _blocks("noise_refiner", routed=False),
                     _blocks("layers")),
        text=lambda cfg: TextSpec(cfg["cap_feat_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 16,
            "hidden_size": 32,
            "num_layers": 8,
            "num_refiner_layers": 2,
            "num_attention_heads": 2,
            "num_kv_heads": 2,
            "multiple_of": 16,
            "axes_dim_rope": (4, 6, 6),  # sums to the head dim
            "axes_lens": (64, 32, 32),
            "cap_feat_dim": 32,
        },
        latent_channels=16,
        limits=axes_lens(text_margin=1),
        comfy_latents=FLUX,
        text_encoders=TextEncoders("gemma2", max_length=256, hidden_layer=-2),  # Gemma 2 2B
        notes=(
            "context_refiner and noise_refiner are called directly by the model: never checkpointed",
            "time runs backwards (t = 1 - sigma) and the raw output is x0 - noise; the adapter negates it",
        ),
    )
)
