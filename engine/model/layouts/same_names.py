"""Families released in the diffusers layout, which ComfyUI builds under the same names: the
mapping is the identity.

- Qwen-Image (``comfy/ldm/qwen_image``; diffusers' single-file entry is an identity too).
- HiDream-I1 (``comfy/ldm/hidream/model.py``): diffusers' ``convert_hidream_transformer_to_diffusers``
  only strips a full checkpoint's ``model.diffusion_model.`` prefix.
"""

from __future__ import annotations

from . import OriginalLayout, StateDict, diffusers_converter, register_layout


def identity(state: StateDict) -> StateDict:
    """The same keys and tensors (a new dict)."""
    return dict(state)


QWENIMAGE = register_layout(OriginalLayout("qwenimage", identity, identity,
                                           "Qwen's release, in the diffusers layout"))
HIDREAM = register_layout(OriginalLayout("hidream", identity, diffusers_converter("HiDreamImageTransformer2DModel"),
                                         "HiDream-ai's release, in the diffusers layout; diffusers' "
                                         "convert_hidream_transformer_to_diffusers (strips the prefix only)"))
