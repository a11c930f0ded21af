"""Flux.2 and Flux.2 Klein (``Flux2Transformer2DModel``): a double-stream list, then a single-stream list.

Source: ``diffusers/models/transformers/transformer_flux2.py`` (forward loop) and
``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (how the pipeline calls the transformer).
Conventions: 32-channel ``AutoencoderKLFlux2`` latents, 2x2-packed into 128-channel tokens; 4-D ids
``(t, h, w, l)``; the timestep is sigma (the model multiplies by 1000); no text mask.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..packing import pack_2x2, read_packed_2x2
from ..registry import register_family

# double: block(hidden, encoder, mod_img, mod_txt, rope, kv_attn_kwargs) -> (encoder, hidden);
# single: block(joint, None, mod_single, rope, kv_attn_kwargs_single) -> joint, on the already
# concatenated [text, image] sequence (split_hidden_states stays False). The modulation tensors are
# computed once before the loops. The KV cache (kv_cache_mode "extract" / "cached", reference-image
# editing) is the one per-block state: the model writes kv_cache.get_double(i) / get_single(i) into
# ONE kv_attn_kwargs dict in place before each block. The runner copies each call's argument
# containers, so every recompute sees its own block's entry and a grouped segment sees the entry
# change and falls back to per-block (tests/train/test_faults.py); training builds the text-to-image
# call, where kv_attn_kwargs is None for every block.
_DOUBLE = Carry(((0, 1), (1, 0)))


def _image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    """``(h * w, 4)`` ids ``(t=0, h, w, l=0)`` of a packed ``height x width`` token grid."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width),
                                torch.arange(1)).to(device=device, dtype=torch.float32)


def _text_ids(length: int, device: torch.device) -> torch.Tensor:
    """``(L, 4)`` ids ``(t=0, h=0, w=0, l)``: text advances along the L axis."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                torch.arange(length)).to(device=device, dtype=torch.float32)


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    inputs = {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": text.seq,
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "img_ids": _image_ids(h // 2, w // 2, latents.device),
        "txt_ids": _text_ids(text.seq.shape[1], latents.device),
        "return_dict": False,
    }
    if model.config.guidance_embeds:  # Flux.2 [dev]; Klein checkpoints have no guidance embedder
        inputs["guidance"] = torch.ones(b, device=latents.device, dtype=latents.dtype)
    return inputs


# FFN boundary: the double blocks call ff (Flux2FeedForward) on one tensor. The single blocks are
# "parallel" blocks whose MLP input projection is fused into attn.to_qkv_mlp_proj and output
# projection into attn.to_out, inside the attention processor: no FFN sub-module, so *-ffn backends
# fail naming the single list (the documents do not list Flux.2 among the FFN-split families).
FLUX2 = register_family(
    FamilyAdapter(
        name="flux2",
        model_class="Flux2Transformer2DModel",
        flow_shift=FlowShift(3.0, use_dynamic_shifting=True, mu_steps=50,
                             mu_rule="flux2.pipeline_flux2:compute_empirical_mu",
                             source="black-forest-labs/FLUX.2-dev scheduler config, as ai-toolkit and SimpleTuner "
                             "declare it; Flux2Pipeline's compute_empirical_mu at its default 50 steps"),
        guidance_input=True,
        block_lists=(
            BlockList("double", "transformer_blocks", _DOUBLE, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", SINGLE, ffn=None, attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"]),
        make_inputs=_make_inputs,
        read_output=read_packed_2x2,
        tiny_config={
            "patch_size": 1,
            "in_channels": 128,
            "num_layers": 8,
            "num_single_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_guidance_channels": 32,
            "axes_dims_rope": (4, 4, 4, 4),  # sums to the head dim
            "guidance_embeds": True,
        },
        latent_channels=32,
        patch=2,  # make_inputs packs 2x2 latents (config patch_size is 1)
        # the single blocks' attention is Flux2ParallelSelfAttention: to_q/to_k/to_v/to_out.0 exist only
        # in the double blocks; to_qkv_mlp_proj reaches the single list (as in diffusers' Klein LoRA script)
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj"),
        notes=(
            "also Flux.2 Klein (guidance_embeds=False); Flux.2 [dev] gets guidance 1.0",
            "single-stream blocks fuse the MLP into the attention projections (to_qkv_mlp_proj, to_out): "
            "no FFN boundary, so *-ffn backends fail for this family",
            "single-stream attention boundary is Flux2ParallelSelfAttention, which includes the fused MLP",
            "KV-cache modes (reference-image editing) change a shared kwargs dict in place per block: "
            "not built here; training runs text-to-image with kv_cache_mode=None",
        ),
    )
)
