"""Qwen-Image (``QwenImageTransformer2DModel``): one list of dual-stream (MMDiT) blocks.

Latents come from ``AutoencoderKLQwenImage`` as single-frame video latents ``(B, C, 1, H, W)``;
the transformer takes them 2x2-packed, with ``img_shapes`` giving each sample's packed grid for
RoPE. As in the pipeline, an all-true text mask is passed as ``None``. ControlNet residuals added
between blocks are not modelled: the runner detects them and falls back to per-block.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import QWEN_IMAGE_TEMPLATE, WAN21, TextEncoders
from ..lazy import torch
from ..packing import pack_2x2, unpack_2x2
from ..registry import register_family

# block(hidden, encoder, encoder_mask, temb, image_rotary_emb, attention_kwargs, modulate_index)
# -> (encoder, hidden)
_CARRY = Carry(((0, 1), (1, 0)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, _, h, w = latents.shape
    return {
        "hidden_states": pack_2x2(latents[:, :, 0]),
        "encoder_hidden_states": text.seq,
        "encoder_hidden_states_mask": None if bool(text.mask.all()) else text.mask,
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "img_shapes": [[(1, h // 2, w // 2)]] * b,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return unpack_2x2(output[0], latents.shape[-2], latents.shape[-1]).unsqueeze(2)


QWENIMAGE = register_family(
    FamilyAdapter(
        name="qwenimage",
        model_class="QwenImageTransformer2DModel",
        flow_shift=FlowShift(use_dynamic_shifting=True, max_shift=0.9, max_image_seq_len=8192,
                             shift_terminal=0.02,
                             mu_rule="qwenimage.pipeline_qwenimage:calculate_shift",
                             source="Qwen/Qwen-Image scheduler_config.json, as ai-toolkit copies it"),
        block_lists=(BlockList("blocks", "transformer_blocks", _CARRY, ffn="img_mlp", attention="attn"),),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "patch_size": 2,
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": (4, 6, 6),
        },
        latent_channels=16,
        patch=2,  # make_inputs packs 2x2 latents
        comfy_latents=WAN21.one_frame(),  # ComfyUI QwenImage: latent_formats.Wan21
        text_encoders=TextEncoders("qwen2_5_vl", max_length=1024, template=QWEN_IMAGE_TEMPLATE, drop=34),
        video_latents=True,
        notes=(
            "latents are single-frame video latents (B, C, 1, H, W) from AutoencoderKLQwenImage",
            "FFN boundary is the image stream's img_mlp; the text stream's txt_mlp stays in the block",
            "text-to-image only: edit/layered variants (zero_cond_t, additional_t_cond) are not built here",
        ),
    )
)
