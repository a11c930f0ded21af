"""Wan 2.1 / 2.2: Wan-AI's layout (``wan/modules/model.py``), as ComfyUI builds it.

The renames are diffusers' own (``TRANSFORMER_KEYS_RENAME_DICT`` of
``convert_wan_transformer_to_diffusers``, read from its source); the conversion is that function.
Two original keys become one diffusers key in two places, resolved as the released files store
them: the head's modulation (``head.modulation``; a block's is ``blocks.N.modulation``) and the
output projection (``head.head``; ``after_proj`` is VACE's, whose blocks hold it).

Wan 2.1 VACE (Wan-AI's ``wan/modules/vace_model.py``, ComfyUI's ``VaceWanModel``) is Wan's layout
plus the VACE blocks, which the same function converts (``before_proj`` -> ``proj_in``,
``after_proj`` -> ``proj_out``; ``vace_patch_embedding`` keeps its name); a VACE block's
``proj_out`` is its ``after_proj`` (not ``head.head``), its ``scale_shift_table`` its ``modulation``.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from . import OriginalLayout, StateDict, register_layout
from .renames import diffusers_renames, rename_all

RESOLVE = {
    r"^scale_shift_table$": "head.modulation",
    r"^blocks\.(\d+)\.scale_shift_table$": r"blocks.\1.modulation",
    r"^proj_out\.": "head.head.",
}


def wan_to_original(state: StateDict) -> StateDict:
    """``WanTransformer3DModel`` keys -> Wan-AI's layout (renames only; tensors unchanged). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    return rename_all(state, diffusers_renames(convert_wan_transformer_to_diffusers, "TRANSFORMER_KEYS_RENAME_DICT"), RESOLVE)


WAN = register_layout(OriginalLayout("wan", wan_to_original, convert_wan_transformer_to_diffusers,
                                     "Wan-AI's layout; diffusers' convert_wan_transformer_to_diffusers"))


VACE_RESOLVE = {
    r"^vace_blocks\.(\d+)\.scale_shift_table$": r"vace_blocks.\1.modulation",
    r"^vace_blocks\.(\d+)\.proj_out\.": r"vace_blocks.\1.after_proj.",
    **RESOLVE,
}


def wanvace_to_original(state: StateDict) -> StateDict:
    """``WanVACETransformer3DModel`` keys -> Wan-AI's VACE layout (renames only). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    return rename_all(state, diffusers_renames(convert_wan_transformer_to_diffusers, "TRANSFORMER_KEYS_RENAME_DICT"),
                      VACE_RESOLVE)


WANVACE = register_layout(OriginalLayout("wanvace", wanvace_to_original, convert_wan_transformer_to_diffusers,
                                         "Wan-AI's VACE layout; diffusers' convert_wan_transformer_to_diffusers"))
