"""ComfyUI's V3 node API as the pack's nodes import it: ``io`` and ``ComfyExtension``.

Inside ComfyUI they are its pinned snapshot ``comfy_api.v0_0_2`` (shipped since ComfyUI 0.3.64,
the pack's minimum; ``comfy_api.latest`` changes between releases). Without ComfyUI (``segckpt
run``, the tests) they are :mod:`.v3_standin`, which declares and renders the part of that API the
nodes use the same way (``tests/live/test_comfyui_server_health.py`` compares the two renderings,
ComfyUI's ``/object_info``, with the fixture recorded before the nodes moved to V3).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("comfy_api") is not None:  # inside ComfyUI
    from comfy_api.v0_0_2 import ComfyExtension, io
else:
    from . import v3_standin as io
    from .v3_standin import ComfyExtension

__all__ = ["ComfyExtension", "io", "overridden"]


def overridden(cls: type, name: str):
    """``cls``'s classmethod ``name`` when a node class defines it (not ``io.ComfyNode``'s
    placeholder), else ``None``: which optional V3 methods (``validate_inputs``,
    ``fingerprint_inputs``) a node has, as ComfyUI's ``execution.py`` asks."""
    for klass in cls.__mro__:
        if klass is io.ComfyNode or klass is object:
            return None
        if name in vars(klass):
            return getattr(cls, name)
    return None
