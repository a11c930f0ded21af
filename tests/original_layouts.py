"""The released layouts tests write their tiny models in (to load them as users' single files are
loaded, by the pack and by ComfyUI): the engine's own inverse conversions
(``engine/model/layouts/``), each checked against diffusers' forward conversion
(tests/model/test_single_file.py, tests/model/test_layouts.py)."""

from __future__ import annotations

from segmented_checkpointing.engine.model.layouts import get_layout, layout_families


def flux_to_bfl(state: dict) -> dict:
    """``FluxTransformer2DModel`` keys -> Black Forest Labs' Flux.1 layout."""
    return get_layout("flux").to_original(state)


def sd3_to_mmdit(state: dict) -> dict:
    """``SD3Transformer2DModel`` keys -> Stability AI's MMDiT layout (SD3 / SD3.5)."""
    return get_layout("sd3").to_original(state)


TO_ORIGINAL = {name: get_layout(name).to_original for name in layout_families()}
