"""Flux.3 Image Klein (``Flux3Transformer2DModel``): per-mode text and image lists, then the joint list.

Source: ``diffusers/models/transformers/transformer_flux3.py`` (forward loop) and
``diffusers/modular_pipelines/flux3/`` (``before_denoise.py``, ``denoise.py``: how the pipeline
calls the transformer). Conventions: 32-channel ``AutoencoderKLFlux2`` latents, 2x2-packed into
128-channel tokens; the timestep is sigma (the model multiplies by 1000); no text mask (Flux.3
attends to padding tokens).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, Carry, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..packing import pack_2x2, read_packed_2x2
from ..registry import register_family

# Three routed lists run in this order, each scheduled on its own (the documents: "image, text,
# reference-image and joint block lists are each split independently"): txt_mode_blocks as
# block(encoder, txt_early_mod, txt_rope) -> encoder; mode_blocks["image"] (in an nn.ModuleDict, so
# declared as the dotted path mode_blocks.image) as block(hidden, image_early_mod, image_rope) ->
# hidden; single_transformer_blocks as block(content, encoder, content_mod, txt_single_mod,
# joint_rope) -> (encoder, content). Every modulation tensor and RoPE table is computed once before
# the loops. mode_blocks["image_cond"] only runs for image-to-image calls (image_cond_hidden_states),
# not built here; undeclared, its blocks would be checkpointed one by one as diffusers does.
_JOINT = Carry(((0, 1), (1, 0)))


_IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep(image_rope_scale=0.5)
_LISTS = ("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks")
_MAX_BLOCKS = 64  # per list; the class defaults are 5 per-mode and 28 joint blocks


def _lora_targets() -> tuple[str, ...]:
    """Attention projections of the routed lists only, as full paths: peft matches list entries as
    name suffixes, and a bare ``to_q`` would also hit ``mode_blocks.image_cond``, whose blocks a
    text-to-image step never runs (their LoRA weights would get no gradient)."""
    return tuple(f"{prefix}.{i}.attn.{proj}" for prefix in _LISTS for i in range(_MAX_BLOCKS)
                 for proj in ("to_q", "to_k", "to_v", "to_out.0"))


# ids are 4-D (t, h, w, l): image tokens (0, h/2, w/2, 0) (image_rope_scale=0.5), text (0, 0, 0, l)
def _image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width),
                               torch.arange(1)).to(torch.float32)
    ids[:, 1:3] *= _IMAGE_ROPE_SCALE
    return ids.to(device)


def _text_ids(length: int, device: torch.device) -> torch.Tensor:
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                torch.arange(length)).to(device=device, dtype=torch.float32)


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    _, _, h, w = latents.shape
    return {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": text.seq,
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "img_ids": _image_ids(h // 2, w // 2, latents.device),
        "txt_ids": _text_ids(text.seq.shape[1], latents.device),
        "return_dict": False,
    }


# No FFN or attention boundary, as in the documents (not an FFN-split family; attention offload
# unsupported). Both block types are "parallel" blocks computing attn(x) and ff(x) from the same
# modulated input, and ff is one module on one tensor, so an FFN region would give correct
# gradients; but with attention-only LoRA the first block of the text and image lists has nothing
# trainable upstream of its ff, autograd never runs that region's backward, and the reported "one
# FFN recompute per checkpointed block" would not hold there. Flow-map (step-distilled,
# flow_map=True) checkpoints need a target_timestep and are not trainable with this objective.
FLUX3 = register_family(
    FamilyAdapter(
        name="flux3",
        model_class="Flux3Transformer2DModel",
        block_lists=(
            BlockList("text", "txt_mode_blocks", SINGLE),
            BlockList("image", "mode_blocks.image", SINGLE),
            BlockList("joint", "single_transformer_blocks", _JOINT),
        ),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"]),
        make_inputs=_make_inputs,
        read_output=read_packed_2x2,
        tiny_config={
            "in_channels": 128,
            "cond_in_channels": 128,
            "num_layers": 8,
            "num_single_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_channels": 32,
            "mlp_ratio": 2.0,
            "axes_dims_rope": (4, 4, 4, 4),  # sums to the head dim
        },
        latent_channels=32,
        patch=2,  # make_inputs packs 2x2 latents
        lora_targets=_lora_targets(),
        notes=(
            "default LoRA targets: to_q/to_k/to_v/to_out.0 of the text, image and joint lists (full "
            "paths, so the unused reference-image blocks get no LoRA)",
            "the text, image and joint lists are scheduled independently; the reference-image list "
            "(mode_blocks.image_cond, image-to-image only) is not built here",
            "*-ffn backends and attention offload unsupported (as documented for Flux.3 Image Klein)",
            "flow-map (step-distilled) checkpoints need target_timestep: not trainable here",
        ),
    )
)
