"""Wan 2.1 / 2.2: Wan-AI's layout (``wan/modules/model.py``), as ComfyUI builds it.

The renames are diffusers' own (``TRANSFORMER_KEYS_RENAME_DICT`` of
``convert_wan_transformer_to_diffusers``, read from its source); the conversion is that function.
Two original keys become one diffusers key in two places, resolved as the released files store
them: the head's modulation (``head.modulation``; a block's is ``blocks.N.modulation``) and the
output projection (``head.head``; ``after_proj`` is VACE's, whose blocks hold it).
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
