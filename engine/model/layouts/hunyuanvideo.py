"""HunyuanVideo: the layout of ComfyUI's model (``comfy/ldm/hunyuan_video/model.py``, built on
ComfyUI's Flux layers), which is what a ComfyUI LoRA names; released files in Tencent's layout
(``hyvideo/modules/models.py``) convert too.

The two layouts differ in names only. Tencent's release stores ``double_blocks.N.img_attn_qkv``,
``img_mod.linear``, ``img_mlp.fc1``, ``img_attn_q_norm.weight``, ``time_in.mlp.0``, ...;
ComfyUI renames them on load (``comfy/supported_models.py`` ``HunyuanVideo.process_unet_state_dict``)
to its model's ``double_blocks.N.img_attn.qkv``, ``img_mod.lin``, ``img_mlp.0``,
``img_attn.norm.query_norm.scale``, ``time_in.in_layer``, ...: :data:`COMFYUI_RENAMES`, those
replacements in ComfyUI's order (ComfyUI is no dependency of this package, so they are listed here).
``to_original`` gives ComfyUI's names (``diffusion_model.<name>`` is the LoRA key ComfyUI maps;
its map also takes Tencent-style names, for diffusion-pipe LoRAs). ``from_original`` takes either:
ComfyUI's names are renamed back to Tencent's, and the result goes to diffusers' conversion.

diffusers' ``convert_hunyuan_video_transformer_to_diffusers`` is the mapping: its
``TRANSFORMER_KEYS_RENAME_DICT`` (read from its source), then its handlers, whose renames are
``str.replace`` calls read from their source too (:func:`replace_calls`: the token refiner's
``rename_key``, the single blocks' ``remap_single_transformer_blocks_``). The handlers split
``double_blocks.N.{img,txt}_attn_qkv`` and the refiner's ``self_attn_qkv`` in three equal parts and
swap the final modulation ``[shift; scale]``; the single blocks' ``linear1`` (``[q; k; v; mlp]``)
they split with the released width (``hidden_size = 3072``), so :func:`hunyuanvideo_from_original`
splits it first with the width read from the tensors (``linear2``'s rows) and hands everything else
to diffusers' function: any width converts.

The chain maps several of Tencent's fragments to one diffusers name (``img_attn_proj`` and
``self_attn_proj`` both become ``attn.to_out.0``, ``linear2`` and ``final_layer.linear`` both
``proj_out``, ...), so its inverse (:func:`~.renames.inverse_rename`) is told, per part of the
model, which one the released file has (``*_RESOLVE``); ``tests/model/test_layouts_video.py``
checks the result against the model ComfyUI builds.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers as _diffusers_convert

from . import OriginalLayout, StateDict, register_layout
from .flux import indices, swap_halves
from .renames import LayoutError, Pairs, diffusers_renames, forward_rename, inverse_rename

RELEASED_WIDTH = 3072
"""The width diffusers' conversion assumes for ``single_blocks.N.linear1``."""

COMFYUI_RENAMES: Pairs = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"),
    ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    (".q_norm.weight", ".norm.query_norm.scale"),
    (".k_norm.weight", ".norm.key_norm.scale"),
    ("_attn_proj.", "_attn.proj."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
)
"""``(Tencent's name fragment, ComfyUI's)``, in the order ComfyUI 0.3.64 applies them on load."""

COMFYUI_RESOLVE = {
    r"^vector_in\.": "vector_in.",
    r"^(time|guidance)_in\.in_layer\.": r"\1_in.mlp.0.",
    r"^(time|guidance)_in\.out_layer\.": r"\1_in.mlp.2.",
}
"""Where undoing ComfyUI's renames leads further than Tencent's names: ``vector_in`` is both layouts'
name, ``time_in``/``guidance_in`` are ``mlp.0``/``mlp.2`` (not ``mlp.fc1``/``mlp.fc2``)."""

REFINER_RESOLVE = {
    r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_1\.": "txt_in.t_embedder.mlp.0.",
    r"^context_embedder\.time_text_embed\.timestep_embedder\.linear_2\.": "txt_in.t_embedder.mlp.2.",
    r"^context_embedder\.time_text_embed\.text_embedder\.linear_([12])\.": r"txt_in.c_embedder.linear_\1.",
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.norm2\.": r"txt_in.individual_token_refiner.blocks.\1.norm2.",
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.attn\.to_out\.0\.":
        r"txt_in.individual_token_refiner.blocks.\1.self_attn_proj.",
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.ff\.net\.0\.proj\.":
        r"txt_in.individual_token_refiner.blocks.\1.mlp.fc1.",
    r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.ff\.net\.2\.":
        r"txt_in.individual_token_refiner.blocks.\1.mlp.fc2.",
}
"""The token refiner's modules: ``t_embedder``, ``c_embedder``, and in its blocks ``norm2``,
``self_attn_proj``, ``mlp.fc1``/``mlp.fc2`` (undoing the chain would also reach ``time_in``,
``vector_in``, ``img_norm2``, ``img_attn_proj``, ``img_mlp``)."""

BLOCK_RESOLVE = {r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.": r"double_blocks.\1.img_attn_proj."}
"""A double block's image output projection is ``img_attn_proj`` (the refiner's ``self_attn_proj``
becomes ``attn.to_out.0`` too)."""

SINGLE_RESOLVE = {
    r"^single_transformer_blocks\.(\d+)\.attn\.norm_([qk])\.": r"single_blocks.\1.\2_norm.",
    r"^single_transformer_blocks\.(\d+)\.proj_out\.": r"single_blocks.\1.linear2.",
}
"""A single block's q/k norms are ``q_norm``/``k_norm`` and its output ``linear2`` (a double block's
``img_attn_q_norm`` becomes ``attn.norm_q`` too, the final layer's ``linear`` ``proj_out``)."""

_PARAMS = ("weight", "bias")
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # linear1 = [q; k; v; mlp-in]


@functools.cache
def replace_calls(function, inner: str) -> Pairs:
    """The ``(old, new)`` literals of the ``.replace(old, new)`` calls in the function ``inner``
    defined inside ``function``, in source order, each once.

    Raises:
        LayoutError: no such function, or it makes no literal replacement (the diffusers version
            changed the conversion: the message names it).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == inner), None)
    calls = sorted((node.lineno, node.col_offset, node.args[0].value, node.args[1].value)
                   for node in (ast.walk(found) if found is not None else ())
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "replace" and len(node.args) == 2
                   and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args))
    pairs = tuple(dict.fromkeys((old, new) for _, _, old, new in calls))
    if not pairs:
        raise LayoutError(f"diffusers' {function.__name__} defines no {inner} with literal str.replace calls")
    return pairs


def _renames() -> tuple[Pairs, Pairs, Pairs]:
    """diffusers' chain, and the chain followed by the refiner's and by the single blocks' renames."""
    chain = diffusers_renames(_diffusers_convert, "TRANSFORMER_KEYS_RENAME_DICT")
    return (chain, chain + replace_calls(_diffusers_convert, "rename_key"),
            chain + replace_calls(_diffusers_convert, "remap_single_transformer_blocks_"))


def _join(sd: StateDict, out: StateDict, parts, into: str) -> None:
    for p in _PARAMS:
        if f"{parts[0]}.{p}" in sd:
            out[f"{into}.{p}"] = torch.cat([sd.pop(f"{n}.{p}") for n in parts])


def hunyuanvideo_to_released(state: StateDict) -> StateDict:
    """``HunyuanVideoTransformer3DModel`` keys -> Tencent's released layout, row-wise (q, k, v and
    the single blocks' MLP input joined along dim 0, the final modulation reordered). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    chain, refiner, single = _renames()
    sd, out = dict(state), {}
    for i in indices(sd, "transformer_blocks."):
        a = f"transformer_blocks.{i}.attn."
        _join(sd, out, [a + n for n in ("to_q", "to_k", "to_v")], f"double_blocks.{i}.img_attn_qkv")
        _join(sd, out, [a + n for n in ("add_q_proj", "add_k_proj", "add_v_proj")], f"double_blocks.{i}.txt_attn_qkv")
    for i in indices(sd, "single_transformer_blocks."):
        _join(sd, out, [f"single_transformer_blocks.{i}.{n}" for n in _SINGLE_FUSED], f"single_blocks.{i}.linear1")
    for i in indices(sd, "context_embedder.token_refiner.refiner_blocks."):
        a = f"context_embedder.token_refiner.refiner_blocks.{i}.attn."
        _join(sd, out, [a + n for n in ("to_q", "to_k", "to_v")], f"txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv")
    for p in _PARAMS:
        if f"norm_out.linear.{p}" in sd:
            out[f"final_layer.adaLN_modulation.1.{p}"] = swap_halves(sd.pop(f"norm_out.linear.{p}"))
    for key, tensor in sd.items():
        if key.startswith("context_embedder."):
            out[inverse_rename(key, refiner, REFINER_RESOLVE)] = tensor
        elif key.startswith("single_transformer_blocks."):
            out[inverse_rename(key, single, SINGLE_RESOLVE)] = tensor
        else:
            out[inverse_rename(key, chain, BLOCK_RESOLVE)] = tensor
    return out


def hunyuanvideo_to_original(state: StateDict) -> StateDict:
    """``HunyuanVideoTransformer3DModel`` keys -> ComfyUI's model layout (Tencent's, renamed as
    ComfyUI loads it), row-wise. A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    return {forward_rename(k, COMFYUI_RENAMES): v for k, v in hunyuanvideo_to_released(state).items()}


def comfyui_to_released(checkpoint: StateDict) -> StateDict:
    """ComfyUI's names -> Tencent's (Tencent's names are kept). A new dict.

    Raises:
        LayoutError: a ComfyUI-style key no Tencent key maps to.
    """
    return {(k if forward_rename(k, COMFYUI_RENAMES) != k else inverse_rename(k, COMFYUI_RENAMES, COMFYUI_RESOLVE)): v
            for k, v in checkpoint.items()}


def hunyuanvideo_from_original(checkpoint: StateDict) -> StateDict:
    """ComfyUI's or Tencent's layout -> diffusers keys at any width (see the module docstring);
    consumes ``checkpoint``."""
    released = comfyui_to_released(checkpoint)
    checkpoint.clear()
    for i in indices(released, "single_blocks."):
        head = f"single_blocks.{i}."
        if f"{head}linear1.weight" not in released:
            continue
        hidden = released[f"{head}linear2.weight"].shape[0]
        for p in _PARAMS:
            if f"{head}linear1.{p}" in released:
                fused = released.pop(f"{head}linear1.{p}")
                sizes = (hidden, hidden, hidden, fused.shape[0] - 3 * hidden)
                for name, part in zip(_SINGLE_FUSED, fused.split(sizes, dim=0)):
                    released[f"{head}{name}.{p}"] = part
    return _diffusers_convert(released)


HUNYUANVIDEO = register_layout(OriginalLayout(
    "hunyuanvideo", hunyuanvideo_to_original, hunyuanvideo_from_original,
    "ComfyUI's HunyuanVideo model layout (Tencent's, renamed as ComfyUI loads it); diffusers' "
    "convert_hunyuan_video_transformer_to_diffusers, its linear1 split sized from the tensors"))
