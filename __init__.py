"""comfyui-segmented-checkpointing: segmented activation checkpointing for LoRA training.

This folder is the Python package ``segmented_checkpointing`` (pip) and a ComfyUI custom-node pack
(``custom_nodes/<any folder name>``). The engine (``engine/``) never imports ComfyUI; the nodes
(``nodes/``, ComfyUI's V3 schema) reach ComfyUI through ``comfy_entrypoint``, defined only when
ComfyUI itself is importable, so the CLI and the tests run without it.
"""

import importlib.util

WEB_DIRECTORY = "./web"
__all__ = ["WEB_DIRECTORY"]

if importlib.util.find_spec("comfy") is not None and importlib.util.find_spec("folder_paths") is not None:
    # ComfyUI loads a pack's V3 extension only when the pack has no NODE_CLASS_MAPPINGS (nodes.py)
    from .nodes import comfy_entrypoint

    __all__ += ["comfy_entrypoint"]
