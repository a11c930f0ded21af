"""Flux.1 and Chroma: Black Forest Labs' layout (``flux`` reference code; Chroma's, lodestones', is
Flux's without the per-block modulations, with a ``distilled_guidance_layer``).

diffusers 0.42's conversions (``convert_flux_transformer_checkpoint_to_diffusers``,
``convert_chroma_transformer_checkpoint_to_diffusers``) hard-code the released width
(``inner_dim = 3072``) to split ``single_blocks.N.linear1``, so they convert no other width. At the
released width ``from_original`` hands the file to diffusers' function; at any other width it
applies the same mapping with the split read from the tensors (:func:`flux_original_to_diffusers`).
``tests/model/test_layouts.py`` checks that both give the same tensors at the released width.
"""

from __future__ import annotations

import torch

from . import OriginalLayout, StateDict, diffusers_converter, register_layout

RELEASED_WIDTH = 3072
"""The width diffusers' Flux and Chroma conversions assume (``inner_dim``)."""

_TOP = {  # BFL module -> diffusers module (weight and bias)
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "txt_in": "context_embedder",
    "img_in": "x_embedder",
    "final_layer.linear": "proj_out",
    "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
    "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj",
}
_GUIDANCE = {"in_layer": "linear_1", "out_layer": "linear_2"}  # Chroma's distilled_guidance_layer.layers.N
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
}
_DOUBLE_NORMS = {  # BFL ``.scale`` -> diffusers ``.weight``
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # linear1 = [q; k; v; mlp-in]
_PARAMS = ("weight", "bias")


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """``[shift; scale]`` (BFL, SD3) <-> ``[scale; shift]`` (diffusers' ``AdaLayerNormContinuous``), along dim 0."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def indices(keys, prefix: str) -> list[int]:
    """Sorted block indices N of keys ``<prefix>N.<...>``."""
    return sorted({int(k[len(prefix):].split(".", 1)[0]) for k in keys
                   if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()})


def _move(src: dict, dst: dict, old: str, new: str, params=_PARAMS) -> None:
    for p in params:
        if f"{old}.{p}" in src:
            dst[f"{new}.{p}"] = src.pop(f"{old}.{p}")


def _norms(src: dict, dst: dict, table: dict, old_prefix: str, new_prefix: str, old_p: str, new_p: str) -> None:
    for old, new in table.items():
        a, b = (old, new) if old_p == "scale" else (new, old)
        if f"{old_prefix}{a}.{old_p}" in src:
            dst[f"{new_prefix}{b}.{new_p}"] = src.pop(f"{old_prefix}{a}.{old_p}")


def flux_original_to_diffusers(checkpoint: StateDict) -> StateDict:
    """A Flux.1 or Chroma transformer in Black Forest Labs' layout -> diffusers keys, at any width.

    Fused tensors are split: ``double_blocks.N.{img,txt}_attn.qkv`` (3H, H) into q, k, v;
    ``single_blocks.N.linear1`` (3H + M, H) into q, k, v (H rows each) and the MLP input (M rows),
    H read from ``linear2``'s rows (its output width); ``final_layer.adaLN_modulation.1`` is reordered
    ``[shift; scale] -> [scale; shift]``. Works on ``meta`` tensors and on GGUF weights (it splits
rows only, and rows are whole quantization blocks: exact on the raw data); consumes ``checkpoint``.

    Raises:
        KeyError: keys the mapping does not know are left over (named).
    """
    out: StateDict = {}
    for old, new in _TOP.items():
        _move(checkpoint, out, old, new)
    for i in indices(checkpoint, "distilled_guidance_layer.layers."):
        for old, new in _GUIDANCE.items():
            _move(checkpoint, out, f"distilled_guidance_layer.layers.{i}.{old}", f"distilled_guidance_layer.layers.{i}.{new}")
        _norms(checkpoint, out, {f"{i}": f"{i}"}, "distilled_guidance_layer.norms.", "distilled_guidance_layer.norms.",
               "scale", "weight")
    for p in _PARAMS:
        if f"final_layer.adaLN_modulation.1.{p}" in checkpoint:
            out[f"norm_out.linear.{p}"] = swap_halves(checkpoint.pop(f"final_layer.adaLN_modulation.1.{p}"))
    for i in indices(checkpoint, "double_blocks."):
        src, dst = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for old, new in _DOUBLE.items():
            _move(checkpoint, out, src + old, dst + new)
        _norms(checkpoint, out, _DOUBLE_NORMS, src, dst, "scale", "weight")
        for old, names in _DOUBLE_QKV.items():
            for p in _PARAMS:
                if f"{src}{old}.{p}" in checkpoint:
                    for name, part in zip(names, checkpoint.pop(f"{src}{old}.{p}").chunk(3, dim=0)):
                        out[f"{dst}{name}.{p}"] = part
    for i in indices(checkpoint, "single_blocks."):
        src, dst = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        hidden = checkpoint[f"{src}linear2.weight"].shape[0] if f"{src}linear2.weight" in checkpoint else None
        for old, new in _SINGLE.items():
            _move(checkpoint, out, src + old, dst + new)
        _norms(checkpoint, out, _SINGLE_NORMS, src, dst, "scale", "weight")
        if f"{src}linear1.weight" in checkpoint and hidden is not None:
            sizes = (hidden, hidden, hidden, checkpoint[f"{src}linear1.weight"].shape[0] - 3 * hidden)
            for p in _PARAMS:
                if f"{src}linear1.{p}" in checkpoint:
                    for name, part in zip(_SINGLE_FUSED, checkpoint.pop(f"{src}linear1.{p}").split(sizes, dim=0)):
                        out[f"{dst}{name}.{p}"] = part
    if checkpoint:
        raise KeyError(f"keys the Flux mapping does not know: {', '.join(sorted(checkpoint)[:5])}")
    return out


def flux_to_original(state: StateDict) -> StateDict:
    """diffusers' ``FluxTransformer2DModel`` / ``ChromaTransformer2DModel`` keys -> Black Forest
    Labs' layout: the inverse of :func:`flux_original_to_diffusers`, row-wise (q, k, v and the
    MLP input joined along dim 0). Returns a new dict.

    Raises:
        KeyError: keys the mapping does not know are left over (named).
    """
    sd, out = dict(state), {}
    for old, new in _TOP.items():
        _move(sd, out, new, old)
    for i in indices(sd, "distilled_guidance_layer.layers."):
        for old, new in _GUIDANCE.items():
            _move(sd, out, f"distilled_guidance_layer.layers.{i}.{new}", f"distilled_guidance_layer.layers.{i}.{old}")
    for i in indices(sd, "distilled_guidance_layer.norms."):
        out[f"distilled_guidance_layer.norms.{i}.scale"] = sd.pop(f"distilled_guidance_layer.norms.{i}.weight")
    for p in _PARAMS:
        if f"norm_out.linear.{p}" in sd:
            out[f"final_layer.adaLN_modulation.1.{p}"] = swap_halves(sd.pop(f"norm_out.linear.{p}"))
    for i in indices(sd, "transformer_blocks."):
        src, dst = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for old, new in _DOUBLE.items():
            _move(sd, out, src + new, dst + old)
        _norms(sd, out, _DOUBLE_NORMS, src, dst, "weight", "scale")
        for old, names in _DOUBLE_QKV.items():
            for p in _PARAMS:
                if f"{src}{names[0]}.{p}" in sd:
                    out[f"{dst}{old}.{p}"] = torch.cat([sd.pop(f"{src}{n}.{p}") for n in names])
    for i in indices(sd, "single_transformer_blocks."):
        src, dst = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for old, new in _SINGLE.items():
            _move(sd, out, src + new, dst + old)
        _norms(sd, out, _SINGLE_NORMS, src, dst, "weight", "scale")
        for p in _PARAMS:
            if f"{src}{_SINGLE_FUSED[0]}.{p}" in sd:
                out[f"{dst}linear1.{p}"] = torch.cat([sd.pop(f"{src}{n}.{p}") for n in _SINGLE_FUSED])
    if sd:
        raise KeyError(f"keys the Flux mapping does not know: {', '.join(sorted(sd)[:5])}")
    return out


def _from_original(model_class: str):
    def convert(checkpoint: StateDict) -> StateDict:
        width = next((t.shape[0] for k, t in checkpoint.items() if k.endswith("img_in.weight")), None)
        if width == RELEASED_WIDTH:
            return diffusers_converter(model_class)(checkpoint)
        return flux_original_to_diffusers(checkpoint)
    return convert


_SOURCE = ("Black Forest Labs' flux reference layout; diffusers' {} at the released width 3072, the same "
           "mapping with sizes read from the tensors at other widths")
FLUX = register_layout(OriginalLayout("flux", flux_to_original, _from_original("FluxTransformer2DModel"),
                                      _SOURCE.format("convert_flux_transformer_checkpoint_to_diffusers")))
CHROMA = register_layout(OriginalLayout("chroma", flux_to_original, _from_original("ChromaTransformer2DModel"),
                                        _SOURCE.format("convert_chroma_transformer_checkpoint_to_diffusers")))
