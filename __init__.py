"""comfyui-segmented-checkpointing: segmented activation checkpointing for LoRA training.

This folder is the Python package ``segmented_checkpointing`` (pip) and a ComfyUI custom-node pack
(``custom_nodes/<any folder name>``). The engine (``engine/``) never imports ComfyUI; the node
classes (``nodes/``) are loaded only when ComfyUI itself is importable, so the CLI and the tests
run without it.
"""

import importlib.util

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
WEB_DIRECTORY = "./web"

if importlib.util.find_spec("comfy") is not None and importlib.util.find_spec("folder_paths") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
