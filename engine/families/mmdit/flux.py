"""Flux.1 (``FluxTransformer2DModel``): a double-stream list, then a single-stream list."""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import FLUX as FLUX_LATENTS
from ..conditioning import TextEncoders
from ..lazy import torch
from ..packing import image_ids, pack_2x2, read_packed_2x2
from ..registry import register_family

# Both lists are called as block(hidden, encoder, temb, rope, joint_attention_kwargs) and
# return (encoder, hidden).
_CARRY = Carry(((0, 1), (1, 0)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    inputs = {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": text.seq,
        "pooled_projections": text.pooled,
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "img_ids": image_ids(h, w, latents.device, latents.dtype),
        "txt_ids": torch.zeros(text.seq.shape[1], 3, device=latents.device, dtype=latents.dtype),
        "return_dict": False,
    }
    if model.config.guidance_embeds:
        inputs["guidance"] = torch.ones(b, device=latents.device, dtype=latents.dtype)
    return inputs


FLUX = register_family(
    FamilyAdapter(
        name="flux",
        model_class="FluxTransformer2DModel",
        flow_shift=FlowShift(3.0, use_dynamic_shifting=True, mu_rule="flux.pipeline_flux:calculate_shift",
                             source="black-forest-labs/FLUX.1-dev scheduler_config.json"),
        guidance_input=True,
        block_lists=(
            BlockList("double", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", _CARRY, ffn=("proj_mlp", "act_mlp"),
                      attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"], cfg["pooled_projection_dim"]),
        make_inputs=_make_inputs,
        read_output=read_packed_2x2,
        tiny_config={
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 8,
            "num_single_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": (4, 6, 6),
        },
        latent_channels=16,
        patch=2,  # make_inputs packs 2x2 latents (config patch_size is 1)
        comfy_latents=FLUX_LATENTS,
        text_encoders=TextEncoders("t5", pooled=("clip",), max_length=512),  # CLIP-L pooled, T5-XXL
        notes=("single-stream blocks: the FFN region is the MLP branch act_mlp(proj_mlp(x)); the "
               "fused output projection stays outside it",),
    )
)
