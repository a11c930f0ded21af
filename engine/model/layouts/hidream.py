"""HiDream-I1: HiDream-ai's release, whose keys are the diffusers ones (ComfyUI's
``comfy/ldm/hidream/model.py`` builds the same names).

diffusers' ``convert_hidream_transformer_to_diffusers`` only strips the ``model.diffusion_model.``
prefix of a full checkpoint: the released transformer keys are ``HiDreamImageTransformer2DModel``'s,
so ``to_original`` is the identity and ``from_original`` is that function.
"""

from __future__ import annotations

from . import OriginalLayout, diffusers_converter, register_layout
from .qwenimage import identity

HIDREAM = register_layout(OriginalLayout("hidream", identity, diffusers_converter("HiDreamImageTransformer2DModel"),
                                         "HiDream-ai's release, in the diffusers layout; diffusers' "
                                         "convert_hidream_transformer_to_diffusers (strips the prefix only)"))
