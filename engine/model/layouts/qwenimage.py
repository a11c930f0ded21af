"""Qwen-Image: released in the diffusers layout, which ComfyUI builds under the same names
(``comfy/ldm/qwen_image``); its mapping is the identity (diffusers' single-file entry is one too)."""

from __future__ import annotations

from . import OriginalLayout, StateDict, register_layout


def identity(state: StateDict) -> StateDict:
    """The same keys and tensors (a new dict)."""
    return dict(state)


QWENIMAGE = register_layout(OriginalLayout("qwenimage", identity, identity,
                                           "Qwen's release, in the diffusers layout"))
