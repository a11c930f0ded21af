"""Flux.2 and Flux.2 Klein (``Flux2Transformer2DModel``): a double-stream list, then a single-stream list.

Source: ``diffusers/models/transformers/transformer_flux2.py`` (forward loop) and
``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (how the pipeline calls the transformer).

Double blocks are called as ``block(hidden, encoder, mod_img, mod_txt, rope, kv_attn_kwargs)`` and
return ``(encoder, hidden)``: carry ``((0, 1), (1, 0))``. Single blocks are called as
``block(joint, None, mod_single, rope, kv_attn_kwargs_single)`` on the already concatenated
``[text, image]`` sequence and return it alone (``split_hidden_states`` stays False): carry
``SINGLE``. The modulation tensors are computed once before the loops, so every non-carried
argument is the same for every block of a list.

The KV cache (``kv_cache_mode="extract"/"cached"``, reference-image editing) is the one per-block
state of this loop: the model writes ``kv_cache.get_double(i)`` / ``get_single(i)`` into ONE
``kv_attn_kwargs`` dict *in place* before each block. A carry map cannot express that (and an
in-place change of a shared dict is not even visible to the runner's argument check, nor to a
plain checkpoint's recompute, which would see the last layer's cache). The adapter builds the
text-to-image training call only, where ``kv_cache_mode`` is None and ``kv_attn_kwargs`` is None
for every block; the KV-cache path is not built here.

FFN boundary: the double blocks call ``ff`` (``Flux2FeedForward``) on one tensor. The single
blocks are "parallel" blocks: the MLP input projection is fused into ``attn.to_qkv_mlp_proj`` and
its output projection into ``attn.to_out`` inside the attention processor, so they have no FFN
sub-module; ``*-ffn`` backends therefore fail for this family, naming the single list (the
documents do not list Flux.2 among the FFN-split families either).

Conventions (``pipeline_flux2_klein.py``): 32-channel ``AutoencoderKLFlux2`` latents are
2x2-packed into 128-channel tokens; ids are 4-D ``(t, h, w, l)``: image tokens ``(0, h, w, 0)``,
text tokens ``(0, 0, 0, l)``; the timestep is sigma (the model multiplies by 1000); no text mask.
"""

from __future__ import annotations

import torch

from .base import (
    SINGLE,
    BlockList,
    Carry,
    FamilyAdapter,
    TextBatch,
    TextSpec,
    register_family,
)
from .packing import pack_2x2, read_packed_2x2

# double: block(hidden, encoder, mod_img, mod_txt, rope, kwargs) -> (encoder, hidden)
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


FLUX2 = register_family(
    FamilyAdapter(
        name="flux2",
        model_class="Flux2Transformer2DModel",
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
