"""Which families ComfyUI runs, and what of a LoRA it applies (ComfyUI 0.3.64, read from its source).

``comfy/supported_models.py`` lists the models ComfyUI builds; ``comfy/lora.py``
``model_lora_keys_unet`` maps, for every model, ``diffusion_model.<key>`` and ``lora_unet_<key with
_>`` of the model's own (released-layout) weights, and for SD3, AuraFlow, PixArt, Flux (and Chroma,
a Flux subclass) and Qwen-Image also the diffusers names ``transformer.<key>``. A LoRA in the
released layout (``lora_format comfyui``, ``engine/model/comfy_lora.py``) needs the family's layout
(``engine/model/layouts/``); this module names them without importing torch, for ``segckpt families``.
"""

from __future__ import annotations

COMFYUI_MODELS = {
    "acestep": "ACEStep", "auraflow": "AuraFlow", "chroma": "Chroma", "cosmos": "CosmosT2V, CosmosT2IPredict2",
    "flux": "Flux", "hidream": "HiDream", "hunyuanvideo": "HunyuanVideo", "lumina2": "Lumina2", "ltxvideo": "LTXV",
    "pixart": "PixArtAlpha, PixArtSigma", "qwenimage": "QwenImage", "sd3": "SD3", "stablecascade": "Stable_Cascade_C",
    "unet2dcondition": "SD15, SDXL", "wan": "WAN21_T2V, WAN22_T2V", "wanvace": "WAN21_Vace",
}
"""Family -> the ``comfy/supported_models.py`` classes (ComfyUI 0.3.64) that build its model."""

DIFFUSERS_KEYS = ("auraflow", "chroma", "flux", "pixart", "qwenimage", "sd3")
"""Families whose diffusers-named LoRA (``transformer.<key>``) ComfyUI 0.3.64 maps too."""

LAYOUT_MODULES = {
    "flux": "flux", "chroma": "flux", "sd3": "sd3", "wan": "wan", "lumina2": "lumina2", "zimage": "zimage",
    "qwenimage": "same_names", "hidream": "same_names", "auraflow": "auraflow", "flux2": "flux2",
    "unet2dcondition": "unet2dcondition", "hunyuanvideo": "hunyuanvideo", "ltxvideo": "ltxvideo", "cosmos": "cosmos",
    "wanvace": "wan",
}
"""Family -> the module of ``engine/model/layouts/`` that holds its released layout."""


def comfyui_lora(family: str) -> str:
    """What ComfyUI 0.3.64 applies of this family's LoRAs, in words (the ``segckpt families`` column)."""
    model = COMFYUI_MODELS.get(family)
    if family in LAYOUT_MODULES:
        names = "`comfyui` files (released-layout names)"
        if model is None:
            return f"{names}; no ComfyUI 0.3.64 model"
        return names + (" and `diffusers` files" if family in DIFFUSERS_KEYS else "")
    if model is None:
        return "no ComfyUI 0.3.64 model"
    if family in DIFFUSERS_KEYS:
        return "`diffusers` files"
    return "no: its layout is not mapped here yet"
