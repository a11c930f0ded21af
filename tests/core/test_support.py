"""Family capabilities: the generated support matrix, per-block-only families, missing boundaries."""

from __future__ import annotations

import warnings

import pytest

from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.plan import ScheduleWarning, effective_plan
from segmented_checkpointing.engine.core.plan_query import reference_block_counts
from segmented_checkpointing.engine.core.support import (
    DOCUMENT_FAMILIES,
    list_capabilities,
    support_table,
)
from segmented_checkpointing.engine.families import family_names, get_family

# docs/SCHEDULES.md "Families named by the documents" (segmented path, FFN-split and sweep
# lists), as written there
SPEC_NAMES = [
    "Flux.1", "Flux.2", "Flux.3 Image Klein", "HunyuanVideo", "Krea 2", "LongCat Image", "LongCat Video",
    "LTXVideo 0.9", "LTXVideo2", "Lumina2", "MageFlow", "MiniMax H3", "PixArt", "Qwen Image 2.1", "SD3",
    "SanaVideo", "Z-Image", "ZLab I1", "Wan", "Stable Cascade", "Chroma", "ACE Step 1.5", "AuraFlow",
    "Cosmos 2 Image", "Cosmos 3", "ERNIE 4.5 Image", "HeartMula", "HiDream", "Ideogram 4.0", "Kandinsky 5 Image",
    "Kandinsky 5 Video", "Kolors", "OmniGen", "Sana", "SD 1.x", "SDXL", "Wan S2V", "Qwen Image", "Boogu Image",
    "HunyuanVideo 1.5",
]
NO_CLASS = {"MageFlow", "ZLab I1", "Boogu Image", "HeartMula", "LongCat Video", "Wan S2V"}


def test_every_family_the_documents_name_has_a_row():
    table = support_table()
    named = dict(DOCUMENT_FAMILIES)
    for name in SPEC_NAMES:
        rows = [title for title in named if title == name or title.startswith(name + " ")]
        assert rows, f"{name} is not in the support matrix"
        for title in rows:
            expected = named[title] or "no diffusers class"
            assert f"| {title} | {expected} |" in table
        if name in NO_CLASS:
            assert named[name] is None, f"{name} has no diffusers class in 0.42"
    assert all(family in family_names() for family in named.values() if family)
    assert set(family_names()) <= set(named.values()) | {"flux"}


def test_every_class_named_by_spec_has_an_adapter():
    classes = {get_family(name).model_class for name in family_names()}
    for cls in ("FluxTransformer2DModel", "Flux2Transformer2DModel", "Flux3Transformer2DModel", "Krea2Transformer2DModel",
                "ChromaTransformer2DModel", "SD3Transformer2DModel", "PixArtTransformer2DModel", "SanaTransformer2DModel",
                "SanaVideoTransformer3DModel", "Lumina2Transformer2DModel", "AuraFlowTransformer2DModel",
                "HiDreamImageTransformer2DModel", "HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel",
                "LTXVideoTransformer3DModel", "LTX2VideoTransformer3DModel", "WanTransformer3DModel",
                "WanVACETransformer3DModel", "QwenImageTransformer2DModel", "QwenImage21Transformer2DModel",
                "ZImageTransformer2DModel", "CosmosTransformer3DModel", "Kandinsky5Transformer3DModel",
                "LongCatImageTransformer2DModel", "OmniGenTransformer2DModel", "MiniMaxH3Transformer3DModel",
                "Ideogram4Transformer2DModel", "ErnieImageTransformer2DModel", "AceStepTransformer1DModel",
                "UNet2DConditionModel", "StableCascadeUNet"):
        assert cls in classes, cls


@pytest.mark.parametrize("family", ["chroma", "hidream", "unet2dcondition", "stablecascade", "acestep", "wanvace"])
def test_per_block_only_families_warn_once_and_the_plan_says_ignored(family):
    adapter = get_family(family)
    counts = dict(reference_block_counts(family, "tiny"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = effective_plan(adapter, CheckpointSchedule(gradient_checkpointing_interval=2), counts)
    schedule_warnings = [w for w in caught if issubclass(w.category, ScheduleWarning)]
    assert len(schedule_warnings) == 1 and "gradient_checkpointing_interval=2" in str(schedule_warnings[0].message)
    assert any("are ignored" in note for note in plan.notes) and "are ignored" in plan.render()
    routed = [p for p, bl in zip(plan.lists, adapter.block_lists) if bl.routed]
    assert all(p.segments == tuple((i, i + 1) for i in range(p.num_blocks)) for p in routed)
    assert all(cap["segments"] in ("per-block only", "none") for cap in list_capabilities(family))


@pytest.mark.parametrize("family", ["ideogram4", "unet2dcondition", "flux2", "stablecascade"])
def test_ffn_backend_without_boundary_fails_naming_the_family(family):
    counts = dict(reference_block_counts(family, "tiny"))
    with pytest.raises(ScheduleError, match=f"not available for {family}: block list"):
        effective_plan(get_family(family), CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"), counts)


def test_unrouted_lists_show_none():
    caps = {c["list"]: c for c in list_capabilities("krea2")}
    assert caps["text_refiner"]["segments"] == "none" and caps["blocks"]["segments"] == "yes"
