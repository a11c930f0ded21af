"""What the engine knows of single-file checkpoints, per family: how a file is recognised, how its
original release layout becomes the diffusers layout, and which config keys its shapes determine.

Each :class:`FileFormat` is data plus two narrow functions. Recognition reads key names only;
the conversions run on real tensors and, unchanged, on ``meta`` tensors built from a file's header
(so a file's variant is decided from shapes before any weight is read).

Sources: the signature keys of the original layouts are those of diffusers'
``single_file_utils.CHECKPOINT_KEY_NAMES`` (ComfyUI's ``comfy/model_detection.py`` tests the same
keys); the conversions are the families' :mod:`.layouts` (diffusers' own functions, wrapped where
diffusers hard-codes the released width), else diffusers' ``SINGLE_FILE_LOADABLE_CLASSES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .layouts.flux import indices

Shapes = Mapping[str, tuple[int, ...]]
"""Tensor shapes by key, the diffusers layout: ``{"x_embedder.weight": (3072, 64), ...}``."""


class ShapeInferenceError(ValueError):
    """The file's shapes do not determine a config (a key is missing, or a config key is not
    stored in any shape); the message says which."""


@dataclass(frozen=True)
class FileFormat:
    """How one family's single files look.

    Attributes:
        family: the family name.
        original: keys (after the ``model.diffusion_model.`` prefix) any of which marks the
            original release layout.
        diffusers: keys all of which mark the diffusers layout.
        convert: original layout -> diffusers layout (``{key: tensor}`` in, a new dict out; it
            may consume its input); ``None``: the family's :class:`~.layouts.OriginalLayout`
            ``from_original``, else diffusers' own function for the family's class.
        infer: diffusers-layout shapes -> the config keys the shapes determine (raises
            :class:`ShapeInferenceError`); ``None``: only the shipped variants are known.
    """

    family: str
    original: tuple[str, ...]
    diffusers: tuple[str, ...] = ()
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    infer: Callable[[Shapes], dict[str, Any]] | None = field(default=None)


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape a tensor stands for: a GGUF weight's ``quant_shape`` (its data is ``(rows, row
    bytes)``), else its own."""
    return tuple(getattr(t, "quant_shape", None) or t.shape)


def _count(shapes: Shapes, prefix: str) -> int:
    """Number of blocks ``<prefix>0 .. <prefix>N-1`` (the highest index + 1)."""
    found = indices(shapes, prefix)
    return found[-1] + 1 if found else 0


def _shape(shapes: Shapes, key: str) -> tuple[int, ...]:
    if key not in shapes:
        raise ShapeInferenceError(f"no {key!r} to read the architecture from")
    return tuple(shapes[key])


FLUX_ROPE_AXES = {128: (16, 56, 56)}
"""Rotary split of the attention head width, by head width: not stored in any tensor, so known only
for the released head width 128 (Black Forest Labs' Flux.1 config; ComfyUI assumes the same)."""


def infer_flux(shapes: Shapes) -> dict[str, Any]:
    """``FluxTransformer2DModel`` config keys from diffusers-layout shapes.

    Widths: ``x_embedder.weight`` (H, C_in); head width D from the q-norm weight (D,); heads H/D;
    blocks from the highest block index; text widths from ``context_embedder`` and the pooled
    ``text_embedder``; ``guidance_embeds`` from the guidance embedder's presence. The rotary
    split (``axes_dims_rope``) is taken from :data:`FLUX_ROPE_AXES`.

    Raises:
        ShapeInferenceError: a key is missing, or the head width has no known rotary split.
    """
    inner, in_channels = _shape(shapes, "x_embedder.weight")
    norm = ("transformer_blocks.0.attn.norm_q.weight" if "transformer_blocks.0.attn.norm_q.weight" in shapes
            else "single_transformer_blocks.0.attn.norm_q.weight")
    head = _shape(shapes, norm)[0]
    if head not in FLUX_ROPE_AXES:
        raise ShapeInferenceError(f"the rotary split axes_dims_rope of head width {head} is not stored in the file "
                                  f"(known for head width {', '.join(map(str, FLUX_ROPE_AXES))})")
    out_channels = _shape(shapes, "proj_out.weight")[0]
    return {
        "patch_size": 1, "in_channels": in_channels,
        "out_channels": None if out_channels == in_channels else out_channels,
        "num_layers": _count(shapes, "transformer_blocks."),
        "num_single_layers": _count(shapes, "single_transformer_blocks."),
        "attention_head_dim": head, "num_attention_heads": inner // head,
        "joint_attention_dim": _shape(shapes, "context_embedder.weight")[1],
        "pooled_projection_dim": _shape(shapes, "time_text_embed.text_embedder.linear_1.weight")[1],
        "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in shapes,
        "axes_dims_rope": FLUX_ROPE_AXES[head],
    }


SD3_HEAD_WIDTH = 64
"""Attention head width of SD3 files without q/k norms (SD3 medium): not stored in any tensor; the
released models all use 64 (Stability AI's configs; ComfyUI's model_detection assumes the same)."""


def infer_sd3(shapes: Shapes) -> dict[str, Any]:
    """``SD3Transformer2DModel`` config keys from diffusers-layout shapes.

    Widths and patch from ``pos_embed.proj.weight`` (H, C_in, P, P); head width from the q-norm
    weight when q/k norms are present (else :data:`SD3_HEAD_WIDTH`); ``pos_embed_max_size`` from
    ``pos_embed.pos_embed`` (1, S*S, H); dual-attention layers from the blocks holding ``attn2``;
    text widths from ``context_embedder`` (caption projection, joint dim) and the pooled embedder.

    Raises:
        ShapeInferenceError: a key is missing.
    """
    inner, in_channels, patch, _ = _shape(shapes, "pos_embed.proj.weight")
    norm = "transformer_blocks.0.attn.norm_q.weight"
    head = _shape(shapes, norm)[0] if norm in shapes else SD3_HEAD_WIDTH
    caption, joint = _shape(shapes, "context_embedder.weight")
    return {
        "patch_size": patch, "in_channels": in_channels,
        "out_channels": _shape(shapes, "proj_out.weight")[0] // (patch * patch),
        "num_layers": _count(shapes, "transformer_blocks."),
        "attention_head_dim": head, "num_attention_heads": inner // head,
        "joint_attention_dim": joint, "caption_projection_dim": caption,
        "pooled_projection_dim": _shape(shapes, "time_text_embed.text_embedder.linear_1.weight")[1],
        "pos_embed_max_size": math.isqrt(_shape(shapes, "pos_embed.pos_embed")[1]),
        "dual_attention_layers": tuple(i for i in indices(shapes, "transformer_blocks.")
                                       if f"transformer_blocks.{i}.attn2.to_q.weight" in shapes),
        "qk_norm": (None if norm not in shapes else
                    "layer_norm" if "transformer_blocks.0.attn.norm_q.bias" in shapes else "rms_norm"),
    }


def infer_auraflow(shapes: Shapes) -> dict[str, Any]:
    """``AuraFlowTransformer2DModel`` config keys from diffusers-layout shapes: the position table's
    length ``pos_embed_max_size`` (``pos_embed.pos_embed`` (1, S, H)), the block counts and the text
    width (``context_embedder`` (H, T)). The rest (width, heads, patch) comes from the first shipped
    config, and the model built must match every shape.

    Raises:
        ShapeInferenceError: a key is missing.
    """
    return {
        "pos_embed_max_size": _shape(shapes, "pos_embed.pos_embed")[1],
        "num_mmdit_layers": _count(shapes, "joint_transformer_blocks."),
        "num_single_dit_layers": _count(shapes, "single_transformer_blocks."),
        "joint_attention_dim": _shape(shapes, "context_embedder.weight")[1],
    }


WAN_HEAD_WIDTH = 128
"""Attention head width of Wan files: not stored in any tensor; every released Wan 2.1 / 2.2 model
uses 128 (Wan-AI's configs: 1.3B 1536 / 12, 14B 5120 / 40), as ComfyUI's model_detection assumes
(``num_heads = dim // 128``)."""


def infer_wan(shapes: Shapes) -> dict[str, Any]:
    """``WanTransformer3DModel`` config keys from diffusers-layout shapes.

    Width, input channels and patch from ``patch_embedding.weight`` (H, C_in, Pt, Ph, Pw); heads
    H / :data:`WAN_HEAD_WIDTH`; FFN width, text width and timestep-frequency width from their first
    Linear layers; output channels from ``proj_out.weight`` rows over the patch volume; blocks from
    the highest block index; the cross-attention norm from the blocks' ``norm2``; an image
    embedder (I2V) from its presence.

    Raises:
        ShapeInferenceError: a key is missing, or the width is not a multiple of the head width.
    """
    inner, in_channels, *patch = _shape(shapes, "patch_embedding.weight")
    if inner % WAN_HEAD_WIDTH:
        raise ShapeInferenceError(f"width {inner} is not a multiple of Wan's head width {WAN_HEAD_WIDTH}")
    image = "condition_embedder.image_embedder.norm1.weight"
    return {
        "patch_size": tuple(patch), "in_channels": in_channels,
        "out_channels": _shape(shapes, "proj_out.weight")[0] // math.prod(patch),
        "num_attention_heads": inner // WAN_HEAD_WIDTH, "attention_head_dim": WAN_HEAD_WIDTH,
        "ffn_dim": _shape(shapes, "blocks.0.ffn.net.0.proj.weight")[0],
        "text_dim": _shape(shapes, "condition_embedder.text_embedder.linear_1.weight")[1],
        "freq_dim": _shape(shapes, "condition_embedder.time_embedder.linear_1.weight")[1],
        "num_layers": _count(shapes, "blocks."),
        "cross_attn_norm": "blocks.0.norm2.weight" in shapes,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in shapes else None,
        "image_dim": _shape(shapes, image)[0] if image in shapes else None,
        "added_kv_proj_dim": inner if "blocks.0.attn2.add_k_proj.weight" in shapes else None,
    }


FORMATS: tuple[FileFormat, ...] = (  # first match wins: Chroma's, Flux.2's and HunyuanVideo's files also hold Flux's keys
    FileFormat("hunyuanvideo", ("txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",),
               ("context_embedder.token_refiner.refiner_blocks.0.norm_out.linear.weight",
                "single_transformer_blocks.0.proj_mlp.weight")),
    FileFormat("chroma", ("distilled_guidance_layer.in_proj.bias",),
               ("distilled_guidance_layer.in_proj.weight", "single_transformer_blocks.0.proj_mlp.weight")),
    FileFormat("flux2", ("single_stream_modulation.lin.weight",),
               ("single_stream_modulation.linear.weight", "time_guidance_embed.timestep_embedder.linear_1.weight")),
    FileFormat("flux", ("double_blocks.0.img_attn.norm.key_norm.scale",),
               ("single_transformer_blocks.0.proj_mlp.weight", "time_text_embed.timestep_embedder.linear_1.weight"),
               infer=infer_flux),
    FileFormat("sd3", ("joint_blocks.0.context_block.adaLN_modulation.1.bias",),
               ("transformer_blocks.0.norm1_context.linear.weight", "pos_embed.proj.weight"), infer=infer_sd3),
    # VACE files hold Wan's keys too
    FileFormat("wanvace", ("vace_blocks.0.after_proj.bias",),
               ("vace_blocks.0.proj_out.weight", "condition_embedder.time_embedder.linear_1.weight")),
    FileFormat("wan", ("head.modulation",), ("condition_embedder.time_embedder.linear_1.weight", "scale_shift_table"),
               infer=infer_wan),
    FileFormat("zimage", ("layers.0.adaLN_modulation.0.weight",), ("all_x_embedder.2-1.weight",)),
    FileFormat("lumina2", ("cap_embedder.0.weight",), ("time_caption_embed.caption_embedder.0.weight",)),
    FileFormat("ltxvideo", ("patchify_proj.weight",),
               ("proj_in.weight", "time_embed.emb.timestep_embedder.linear_1.weight",
                "caption_projection.linear_1.weight")),
    # Predict 2 / 2.5, with NVIDIA's net. prefix or without it (ComfyUI strips it)
    FileFormat("cosmos", ("net.blocks.0.self_attn.q_proj.weight", "blocks.0.self_attn.q_proj.weight"),
               ("patch_embed.proj.weight", "time_embed.t_embedder.linear_1.weight",
                "transformer_blocks.0.norm1.linear_1.weight")),
    # Qwen-Image was released in the diffusers layout (no original layout of its own)
    FileFormat("qwenimage", (), ("transformer_blocks.0.img_mod.1.weight", "txt_norm.weight")),
    # HiDream-I1 too (diffusers' conversion strips the prefix only)
    FileFormat("hidream", (), ("double_stream_blocks.0.block.adaLN_modulation.1.bias",)),
    FileFormat("auraflow", ("double_layers.0.attn.w2q.weight",),
               ("register_tokens", "time_step_proj.linear_1.weight"), infer=infer_auraflow),
    # the LDM / SGM UNet: SD 1.x's signature key, or the UNet's input convolution (SDXL, inpainting)
    FileFormat("unet2dcondition", ("output_blocks.11.0.skip_connection.weight", "input_blocks.0.0.weight"),
               ("conv_in.weight", "time_embedding.linear_1.weight", "down_blocks.0.resnets.0.conv1.weight")),
)
"""The families whose single files load; each has shipped variants under ``model_configs/``."""
RECOGNISED_ONLY: tuple[tuple[str, str], ...] = (
    # (family, signature key of its original layout): recognised so that a refusal names them
    ("flux3", "early_stream_modulations.image.lin.weight"),
    ("sana", "blocks.0.cross_attn.q_linear.weight"),
    ("ltx2video", "av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight"),  # LTX-2 holds LTX-Video's keys
    ("qwenimage21", "txt_in.text_norm.weight"),
    ("krea2", "txtfusion.projector.weight"),
    ("minimaxh3", "token_refiner.blocks.0.attn.qkv_proj.weight"),
)
"""Layouts recognised but not loaded from a single file (checked before :data:`FORMATS`, where a
signature could collide: Flux.3 files hold Flux-like keys, LTX-2 files LTX-Video's)."""
