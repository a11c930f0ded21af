"""Wan 2.1 VACE: Wan-AI's layout (``wan/modules/vace_model.py``), as ComfyUI builds it
(``comfy/ldm/wan/model.py`` ``VaceWanModel``).

Wan's layout (:mod:`.wan`: diffusers' ``convert_wan_transformer_to_diffusers``, its renames read
from its source) plus the VACE blocks, which that function converts too (``before_proj`` ->
``proj_in``, ``after_proj`` -> ``proj_out``; ``vace_patch_embedding`` keeps its name). Two more
diffusers keys that two original keys map to, resolved as the released files store them: a VACE
block's ``proj_out`` is its ``after_proj`` (not ``head.head``), its ``scale_shift_table`` its
``modulation``.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from . import OriginalLayout, StateDict, register_layout
from .renames import diffusers_renames, rename_all
from .wan import RESOLVE as WAN_RESOLVE

RESOLVE = {
    r"^vace_blocks\.(\d+)\.scale_shift_table$": r"vace_blocks.\1.modulation",
    r"^vace_blocks\.(\d+)\.proj_out\.": r"vace_blocks.\1.after_proj.",
    **WAN_RESOLVE,
}


def wanvace_to_original(state: StateDict) -> StateDict:
    """``WanVACETransformer3DModel`` keys -> Wan-AI's VACE layout (renames only). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    return rename_all(state, diffusers_renames(convert_wan_transformer_to_diffusers, "TRANSFORMER_KEYS_RENAME_DICT"),
                      RESOLVE)


WANVACE = register_layout(OriginalLayout("wanvace", wanvace_to_original, convert_wan_transformer_to_diffusers,
                                         "Wan-AI's VACE layout; diffusers' convert_wan_transformer_to_diffusers"))
