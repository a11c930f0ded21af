"""Lumina-Image 2.0: Alpha-VLLM's layout (NextDiT), as ComfyUI builds it (``comfy/ldm/lumina``).

The renames are diffusers' own (the four maps of ``convert_lumina2_to_diffusers``, read from its
source, applied in its order). That function splits ``attention.qkv`` with the released sizes
(``q_dim = 2304``, ``k_dim = v_dim = 768``); :func:`lumina2_from_original` splits it first with the
sizes read from the tensors (q: the output projection's rows, the model width, which Lumina 2's heads
span; k, v: half the rest each) and
hands everything else to diffusers' function, so any width converts.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

from . import OriginalLayout, StateDict, register_layout
from .renames import diffusers_renames, join_rows, rename_all

_MAPS = ("CONTEXT_REFINER_MAP", "FINAL_LAYER_MAP", "ATTENTION_NORM_MAP", "LUMINA_KEY_MAP")
RESOLVE = {r"\.ffn_norm2\.": ".ffn_norm2."}
"""``ffn_norm2`` keeps its name (diffusers' ``attention_norm2 -> norm2`` would also map ``ffn_attention_norm2``)."""


def lumina2_to_original(state: StateDict) -> StateDict:
    """``Lumina2Transformer2DModel`` keys -> the released layout (q, k, v joined row-wise). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    pairs = sum((diffusers_renames(convert_lumina2_to_diffusers, name) for name in _MAPS), ())
    return rename_all(join_rows(state, ("to_q", "to_k", "to_v"), "qkv"), pairs, RESOLVE)


def lumina2_from_original(checkpoint: StateDict) -> StateDict:
    """The released layout -> diffusers keys at any width (see the module docstring); consumes ``checkpoint``."""
    for key in [k for k in checkpoint if k.endswith((".attention.qkv.weight", ".attention.qkv.bias"))]:
        head, _, param = key.rpartition(".qkv.")
        fused = checkpoint.pop(key)
        q = checkpoint[f"{head}.out.weight"].shape[0]  # the model width = heads x head width in Lumina 2
        kv = (fused.shape[0] - q) // 2
        for name, part in zip(("to_q", "to_k", "to_v"), fused.split((q, kv, kv), dim=0)):
            checkpoint[f"{head}.{name}.{param}"] = part
    return convert_lumina2_to_diffusers(checkpoint)


LUMINA2 = register_layout(OriginalLayout("lumina2", lumina2_to_original, lumina2_from_original,
                                         "Alpha-VLLM's NextDiT layout; diffusers' convert_lumina2_to_diffusers, "
                                         "its qkv split sized from the tensors"))
