"""LTX-Video 0.9: Lightricks' layout (``ltx_video/models/transformers/transformer3d.py``), as
ComfyUI builds it (``comfy/ldm/lightricks/model.py`` ``LTXVModel``: the same names).

The released layout is diffusers' own but for four names; the renames are diffusers'
(``TRANSFORMER_KEYS_RENAME_DICT`` of ``convert_ltx_transformer_checkpoint_to_diffusers``, read from
its source, without its ``model.diffusion_model.`` prefix entry, which the loader strips); the
conversion is that function (it drops the ``vae.`` tensors of a full checkpoint). Nothing is fused.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

from . import OriginalLayout, StateDict, diffusers_converter, register_layout
from .renames import diffusers_renames, rename_all


def _pairs():
    pairs = diffusers_renames(convert_ltx_transformer_checkpoint_to_diffusers, "TRANSFORMER_KEYS_RENAME_DICT")
    return tuple(p for p in pairs if p[0] != "model.diffusion_model.")


def ltxvideo_to_original(state: StateDict) -> StateDict:
    """``LTXVideoTransformer3DModel`` keys -> Lightricks' layout (renames only). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    return rename_all(state, _pairs())


LTXVIDEO = register_layout(OriginalLayout("ltxvideo", ltxvideo_to_original,
                                          diffusers_converter("LTXVideoTransformer3DModel"),
                                          "Lightricks' LTX-Video layout; diffusers' "
                                          "convert_ltx_transformer_checkpoint_to_diffusers"))
