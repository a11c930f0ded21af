"""Flux.2: Black Forest Labs' layout (``flux2`` reference code), as diffusers converts it.

ComfyUI 0.3.64 has no Flux.2 model (it came in a later ComfyUI); the names are those of BFL's
released files, which diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` reads. That
function renames with four dict literals (read here from its source: the module renames applied to
every key, then the final layer's, the double blocks' and the single blocks' maps), turns the norms'
``.scale`` into ``.weight``, splits each double block's fused ``{img,txt}_attn.qkv`` in three equal
parts and swaps the final modulation's halves. Its split reads no width, so it converts any size;
the inverse joins q, k, v and swaps back, both along dim 0. The single blocks keep their fused
``linear1`` (``attn.to_qkv_mlp_proj`` in diffusers too).
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as _convert

from . import OriginalLayout, StateDict, diffusers_converter, register_layout
from .flux import indices, swap_halves
from .renames import LayoutError, diffusers_renames, join_rows, rename_all

_QKV = {"attn.qkv": "img_attn.qkv", "attn.add_qkv": "txt_attn.qkv"}
"""Each double block's joined ``to_q/k/v`` and ``add_{q,k,v}_proj`` -> the fused original weight
(diffusers splits these in code, by the ``img``/``txt`` in the name)."""


def _block_maps() -> tuple[dict[str, str], dict[str, str]]:
    """``{diffusers module: original module}`` of the double and single blocks (diffusers' maps, inverted)."""
    double = {new: old for old, new in diffusers_renames(_convert, "FLUX2_TRANSFORMER_DOUBLE_BLOCK_KEY_MAP")}
    single = {new: old for old, new in diffusers_renames(_convert, "FLUX2_TRANSFORMER_SINGLE_BLOCK_KEY_MAP")}
    return {**double, **_QKV}, single


def _param(module: str, param: str) -> str:
    """The original parameter name: BFL's q/k norms (``query_norm``, ``key_norm``) store ``scale``."""
    return "scale" if module.endswith("_norm") and param == "weight" else param


def flux2_to_original(state: StateDict) -> StateDict:
    """``Flux2Transformer2DModel`` keys -> Black Forest Labs' layout, row-wise. A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    sd = join_rows(join_rows(state, ("to_q", "to_k", "to_v"), "qkv"), ("add_q_proj", "add_k_proj", "add_v_proj"),
                   "add_qkv")
    double, single = _block_maps()
    (ada_old, ada_new), = diffusers_renames(_convert, "FLUX2_TRANSFORMER_ADA_LAYER_NORM_KEY_MAP")
    out: StateDict = {}
    for prefix, original, table in (("transformer_blocks.", "double_blocks.", double),
                                    ("single_transformer_blocks.", "single_blocks.", single)):
        for i in indices(sd, prefix):
            for key in [k for k in sd if k.startswith(f"{prefix}{i}.")]:
                module, _, param = key[len(f"{prefix}{i}."):].rpartition(".")
                if module not in table:
                    raise LayoutError(f"diffusers key {key!r}: no module of the Flux.2 {original[:-1]} maps to it")
                out[f"{original}{i}.{table[module]}.{_param(table[module], param)}"] = sd.pop(key)
    for key in [k for k in sd if k.startswith(f"{ada_new}.")]:
        out[f"{ada_old}.{key[len(ada_new) + 1:]}"] = swap_halves(sd.pop(key))
    out.update(rename_all(sd, diffusers_renames(_convert, "FLUX2_TRANSFORMER_KEYS_RENAME_DICT")))
    return out


FLUX2 = register_layout(OriginalLayout("flux2", flux2_to_original, diffusers_converter("Flux2Transformer2DModel"),
                                       "Black Forest Labs' flux2 reference layout; diffusers' "
                                       "convert_flux2_transformer_checkpoint_to_diffusers"))
