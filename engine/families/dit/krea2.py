"""Krea 2 (``Krea2Transformer2DModel``): one routed list of single-stream blocks, after a text-fusion stage.

Source: ``diffusers/models/transformers/transformer_krea2.py`` (forward loop) and
``diffusers/pipelines/krea2/pipeline_krea2.py`` (how the pipeline calls the transformer).
Conventions: ``AutoencoderKLQwenImage`` latents (16 channels), 2x2-packed; the timestep is sigma
in [0, 1].
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..packing import pack_2x2, read_packed_2x2
from ..registry import register_family


def _position_ids(text_len: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """``Krea2Pipeline.prepare_position_ids``: text rows at the origin, image rows ``(0, h, w)``."""
    image = torch.zeros(height, width, 3, device=device)
    image[..., 1] = torch.arange(height, device=device)[:, None]
    image[..., 2] = torch.arange(width, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), image.reshape(height * width, 3)])


# The text conditioning is a stack of num_text_layers tapped text-encoder hidden states per token,
# (B, L, num_text_layers, text_hidden_dim); the text batch carries it flattened layer-major to
# (B, L, num_text_layers * text_hidden_dim). position_ids are (L + h*w, 3); the text mask is passed
# as encoder_attention_mask (None when every token is real, as the model's docstring asks).
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    _, _, h, w = latents.shape
    cfg = model.config
    seq = text.seq.unflatten(-1, (cfg.num_text_layers, cfg.text_hidden_dim))
    return {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": seq,
        "timestep": sigmas.to(latents.dtype),  # flow time in [0, 1]; the model scales it itself
        "position_ids": _position_ids(seq.shape[1], h // 2, w // 2, latents.device),
        "encoder_attention_mask": None if bool(text.mask.all()) else text.mask,
        "return_dict": False,
    }


def _unrouted(name: str, attr: str) -> BlockList:
    return BlockList(name, attr, SINGLE, ffn="ff", attention="attn", routed=False)


# The main loop calls transformer_blocks as block(joint, temb_mod, rope, attention_mask) -> joint on
# the concatenated [text, image] sequence; temb_mod is one shared modulation vector (each block adds
# its own learned table inside). The text-fusion stage (text_fusion.layerwise_blocks across the
# tapped-layer axis, then text_fusion.refiner_blocks across tokens) calls its blocks directly, never
# through the checkpoint function: routed=False. FFN boundary: ff (Krea2SwiGLU), called once on
# one tensor after the attention residual; attention boundary: attn (grouped-query self-attention
# with a sigmoid output gate).
KREA2 = register_family(
    FamilyAdapter(
        name="krea2",
        model_class="Krea2Transformer2DModel",
        flow_shift=FlowShift(use_dynamic_shifting=True, max_image_seq_len=6400,
                             mu_rule="krea2.pipeline_krea2:calculate_shift",
                             source="Krea 2 scheduler config, as ai-toolkit declares it"),
        block_lists=(
            _unrouted("text_layerwise", "text_fusion.layerwise_blocks"),
            _unrouted("text_refiner", "text_fusion.refiner_blocks"),
            BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["num_text_layers"] * cfg["text_hidden_dim"]),
        make_inputs=_make_inputs,
        read_output=read_packed_2x2,
        tiny_config={
            "in_channels": 64,
            "num_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # grouped-query attention, as in the released model
            "intermediate_size": 64,
            "timestep_embed_dim": 32,
            "text_hidden_dim": 16,
            "num_text_layers": 2,
            "text_num_attention_heads": 2,
            "text_num_key_value_heads": 2,
            "text_intermediate_size": 32,
            "num_layerwise_text_blocks": 2,
            "num_refiner_text_blocks": 2,
            "axes_dims_rope": (4, 6, 6),  # sums to the head dim
        },
        latent_channels=16,
        patch=2,  # make_inputs packs 2x2 latents
        # the attention layer set diffusers' Krea 2 LoRA script recommends for long runs
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "to_gate"),
        notes=(
            "text_fusion.layerwise_blocks and text_fusion.refiner_blocks are called directly by the "
            "model: never checkpointed (the default LoRA targets reach their attention too)",
            "text conditioning: num_text_layers tapped hidden states per token, flattened layer-major "
            "into one (B, L, num_text_layers * text_hidden_dim) sequence",
            "latents are AutoencoderKLQwenImage latents (16 channels), taken as images (B, C, H, W)",
        ),
    )
)
