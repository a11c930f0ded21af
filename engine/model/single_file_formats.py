"""What the engine knows of single-file checkpoints, per family: how a file is recognised, how its
original release layout becomes the diffusers layout, and which config keys its shapes determine.

Each :class:`FileFormat` is data plus two narrow functions. Recognition reads key names only;
the conversions run on real tensors and, unchanged, on ``meta`` tensors built from a file's header
(so a file's variant is decided from shapes before any weight is read).

Sources: the signature keys of the original layouts are those of diffusers'
``single_file_utils.CHECKPOINT_KEY_NAMES`` (ComfyUI's ``comfy/model_detection.py`` tests the same
keys); the conversions are diffusers' own (``SINGLE_FILE_LOADABLE_CLASSES``), except for Flux,
whose diffusers 0.42 conversion hard-codes the released width (``inner_dim = 3072``) and so cannot
convert any other width: :func:`flux_original_to_diffusers` applies the same published mapping
(Black Forest Labs' ``flux`` reference code -> ``FluxTransformer2DModel``) at any width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

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
            may consume its input); ``None``: diffusers' own function for the family's class.
        infer: diffusers-layout shapes -> the config keys the shapes determine (raises
            :class:`ShapeInferenceError`); ``None``: only the shipped variants are known.
    """

    family: str
    original: tuple[str, ...]
    diffusers: tuple[str, ...] = ()
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    infer: Callable[[Shapes], dict[str, Any]] | None = field(default=None)


_FLUX_TOP = {  # BFL module -> diffusers module (weight and bias)
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
}
_FLUX_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
}
_FLUX_DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
}
_FLUX_DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_FLUX_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_FLUX_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
_FLUX_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # linear1 = [q; k; v; mlp-in]


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape a tensor stands for: a GGUF weight's ``quant_shape`` (its data is ``(rows, row
    bytes)``), else its own."""
    return tuple(getattr(t, "quant_shape", None) or t.shape)


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """``[shift; scale]`` (BFL, SD3) -> ``[scale; shift]`` (diffusers' ``AdaLayerNormContinuous``)."""
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _move(src: dict, dst: dict, old: str, new: str, params: tuple[str, ...] = ("weight", "bias")) -> None:
    for p in params:
        if f"{old}.{p}" in src:
            dst[f"{new}.{p}"] = src.pop(f"{old}.{p}")


def flux_original_to_diffusers(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Flux.1 transformer in Black Forest Labs' layout -> ``FluxTransformer2DModel`` keys.

    Fused tensors are split: ``double_blocks.N.{img,txt}_attn.qkv`` (3H, H) into q, k, v;
    ``single_blocks.N.linear1`` (3H + M, H) into q, k, v (H rows each) and the MLP input (M rows),
    with H read from the tensor itself; ``final_layer.adaLN_modulation.1`` is reordered
    ``[shift; scale] -> [scale; shift]``. Works at any width, on ``meta`` tensors and on GGUF
    weights (rows are whole quantization blocks: the splits are exact on the raw data); consumes
    ``checkpoint``.

    Raises:
        KeyError: keys the mapping does not know are left over (named).
    """
    out: dict[str, torch.Tensor] = {}
    for old, new in _FLUX_TOP.items():
        _move(checkpoint, out, old, new)
    for p in ("weight", "bias"):
        key = f"final_layer.adaLN_modulation.1.{p}"
        if key in checkpoint:
            out[f"norm_out.linear.{p}"] = _swap_halves(checkpoint.pop(key))
    for i in _indices(checkpoint, "double_blocks."):
        src, dst = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for old, new in _FLUX_DOUBLE.items():
            _move(checkpoint, out, src + old, dst + new)
        for old, new in _FLUX_DOUBLE_NORMS.items():
            if src + old in checkpoint:
                out[dst + new] = checkpoint.pop(src + old)
        for old, names in _FLUX_DOUBLE_QKV.items():
            for p in ("weight", "bias"):
                if f"{src}{old}.{p}" in checkpoint:
                    for name, part in zip(names, checkpoint.pop(f"{src}{old}.{p}").chunk(3, dim=0)):
                        out[f"{dst}{name}.{p}"] = part
    for i in _indices(checkpoint, "single_blocks."):
        src, dst = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        for old, new in _FLUX_SINGLE.items():
            _move(checkpoint, out, src + old, dst + new)
        for old, new in _FLUX_SINGLE_NORMS.items():
            if src + old in checkpoint:
                out[dst + new] = checkpoint.pop(src + old)
        if f"{src}linear1.weight" in checkpoint:
            rows, hidden = logical_shape(checkpoint[f"{src}linear1.weight"])
            sizes = (hidden, hidden, hidden, rows - 3 * hidden)
            for p in ("weight", "bias"):
                if f"{src}linear1.{p}" in checkpoint:
                    for name, part in zip(_FLUX_SINGLE_FUSED, checkpoint.pop(f"{src}linear1.{p}").split(sizes, dim=0)):
                        out[f"{dst}{name}.{p}"] = part
    if checkpoint:
        raise KeyError(f"keys the Flux mapping does not know: {', '.join(sorted(checkpoint)[:5])}")
    return out


def _indices(keys, prefix: str) -> list[int]:
    """Sorted block indices N of keys ``<prefix>N.<...>``."""
    return sorted({int(k[len(prefix):].split(".", 1)[0]) for k in keys
                   if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()})


def _count(shapes: Shapes, prefix: str) -> int:
    """Number of blocks ``<prefix>0 .. <prefix>N-1`` (the highest index + 1)."""
    found = _indices(shapes, prefix)
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
        "dual_attention_layers": tuple(i for i in _indices(shapes, "transformer_blocks.")
                                       if f"transformer_blocks.{i}.attn2.to_q.weight" in shapes),
        "qk_norm": (None if norm not in shapes else
                    "layer_norm" if "transformer_blocks.0.attn.norm_q.bias" in shapes else "rms_norm"),
    }


FORMATS: tuple[FileFormat, ...] = (  # first match wins: Chroma's files also hold Flux's signature key
    FileFormat("chroma", ("distilled_guidance_layer.in_proj.bias",),
               ("distilled_guidance_layer.in_proj.weight", "single_transformer_blocks.0.proj_mlp.weight")),
    FileFormat("flux", ("double_blocks.0.img_attn.norm.key_norm.scale",),
               ("single_transformer_blocks.0.proj_mlp.weight", "time_text_embed.timestep_embedder.linear_1.weight"),
               convert=flux_original_to_diffusers, infer=infer_flux),
    FileFormat("sd3", ("joint_blocks.0.context_block.adaLN_modulation.1.bias",),
               ("transformer_blocks.0.norm1_context.linear.weight", "pos_embed.proj.weight"), infer=infer_sd3),
    FileFormat("wan", ("head.modulation",), ("condition_embedder.time_embedder.linear_1.weight", "scale_shift_table")),
    FileFormat("zimage", ("layers.0.adaLN_modulation.0.weight",), ("all_x_embedder.2-1.weight",)),
    FileFormat("lumina2", ("cap_embedder.0.weight",), ("time_caption_embed.caption_embedder.0.weight",)),
    # Qwen-Image was released in the diffusers layout (no original layout of its own)
    FileFormat("qwenimage", (), ("transformer_blocks.0.img_mod.1.weight", "txt_norm.weight")),
)
"""The families whose single files load; each has shipped variants under ``model_configs/``."""
RECOGNISED_ONLY: tuple[tuple[str, str], ...] = (
    # (family, signature key of its original layout): recognised so that a refusal names them
    ("flux2", "single_stream_modulation.lin.weight"),
    ("flux3", "early_stream_modulations.image.lin.weight"),
    ("hunyuanvideo", "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias"),
    ("wanvace", "vace_blocks.0.after_proj.bias"),
    ("hidream", "double_stream_blocks.0.block.adaLN_modulation.1.bias"),
    ("auraflow", "double_layers.0.attn.w2q.weight"),
    ("sana", "blocks.0.cross_attn.q_linear.weight"),
    ("ltxvideo", "patchify_proj.weight"),
    ("qwenimage21", "txt_in.text_norm.weight"),
    ("krea2", "txtfusion.projector.weight"),
    ("minimaxh3", "token_refiner.blocks.0.attn.qkv_proj.weight"),
    ("unet2dcondition", "output_blocks.11.0.skip_connection.weight"),
)
"""Layouts recognised but not loaded from a single file (checked before :data:`FORMATS` where a
signature could collide: Flux.2/Flux.3 and HunyuanVideo files hold Flux-like keys, VACE files Wan's)."""
