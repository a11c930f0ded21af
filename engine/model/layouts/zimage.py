"""Z-Image: Tongyi-MAI's layout, as ComfyUI builds it (``comfy/ldm/lumina`` NextDiT).

The renames are diffusers' own (``Z_IMAGE_KEYS_RENAME_DICT`` of
``convert_z_image_transformer_checkpoint_to_diffusers``, read from its source); the released
files fuse each attention's q, k and v into ``attention.qkv``, which that function splits in
three equal parts.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

from . import OriginalLayout, StateDict, diffusers_converter, register_layout
from .renames import diffusers_renames, join_rows, rename_all


def zimage_to_original(state: StateDict) -> StateDict:
    """``ZImageTransformer2DModel`` keys -> the released layout (q, k, v joined row-wise). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    pairs = tuple(p for p in diffusers_renames(convert_z_image_transformer_checkpoint_to_diffusers, "Z_IMAGE_KEYS_RENAME_DICT") if p[0] != "model.diffusion_model.")
    return rename_all(join_rows(state, ("to_q", "to_k", "to_v"), "qkv"), pairs)


ZIMAGE = register_layout(OriginalLayout("zimage", zimage_to_original, diffusers_converter("ZImageTransformer2DModel"),
                                        "Tongyi-MAI's layout; diffusers' "
                                        "convert_z_image_transformer_checkpoint_to_diffusers"))
