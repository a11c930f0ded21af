"""The released layouts (``engine/model/layouts/``): every family's inverse conversion round-trips
through its forward conversion tensor by tensor; the width-general wrappers give the same tensors as
diffusers' own functions at the released widths; the renames are read from diffusers' source and
inverted by search, ambiguity refused unless the family resolves it; ``row_map`` places every row.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_chroma_transformer_checkpoint_to_diffusers,
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_lumina2_to_diffusers,
    convert_wan_transformer_to_diffusers,
)

from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.layouts import LayoutError, get_layout, layout_families, row_map
from segmented_checkpointing.engine.model.layouts.flux import flux_original_to_diffusers
from segmented_checkpointing.engine.model.layouts.lumina2 import lumina2_from_original
from segmented_checkpointing.engine.model.layouts.renames import diffusers_renames, forward_rename, inverse_rename
from segmented_checkpointing.engine.model.single_file import CONFIG_DIR


def _tiny_state(name):
    family = get_family(name)
    torch.manual_seed(0)
    return family.model_cls()(**family.tiny_config).float().state_dict()


@pytest.mark.parametrize("name", layout_families())
def test_released_layout_round_trips_through_the_forward_conversion(name):
    layout, state = get_layout(name), _tiny_state(name)
    original = {k: v.clone() for k, v in layout.to_original(state).items()}
    back = (layout.from_original(original, dict(get_family(name).tiny_config)) if layout.needs_config
            else layout.from_original(original))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def _row_probe(shapes):
    """One column per tensor, row i of tensor n holding a number unique to (n, i): no full-size tensor."""
    probe, start = {}, 0
    for key, shape in shapes.items():
        rows = shape[0] if shape else 1
        ids = torch.arange(start, start + rows, dtype=torch.float64)
        probe[key] = ids.reshape((rows,) + (1,) * (len(shape) - 1)) if shape else ids.reshape(())
        start += rows
    return probe


def _released(variant, name):
    config = {k: v for k, v in json.loads((CONFIG_DIR / f"{variant}.json").read_text()).items() if k[0] != "_"}
    with torch.device("meta"):
        model = get_family(name).model_cls().from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("variant, name, theirs, ours", [
    ("flux1-dev", "flux", convert_flux_transformer_checkpoint_to_diffusers, flux_original_to_diffusers),
    ("chroma1-hd", "chroma", convert_chroma_transformer_checkpoint_to_diffusers, flux_original_to_diffusers),
    ("lumina-image-2.0", "lumina2", convert_lumina2_to_diffusers, lumina2_from_original),
])
def test_width_general_conversion_equals_diffusers_at_the_released_width(variant, name, theirs, ours):
    shapes = _released(variant, name)
    original = get_layout(name).to_original(_row_probe(shapes))
    a = theirs({k: v.clone() for k, v in original.items()})
    b = ours({k: v.clone() for k, v in original.items()})
    assert a.keys() == b.keys() == shapes.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and from_original hands the released width to diffusers' own function
    assert get_layout(name).from_original({k: v.clone() for k, v in original.items()}).keys() == a.keys()


def test_renames_are_read_from_diffusers_source_and_inverted_by_search():
    pairs = diffusers_renames(convert_wan_transformer_to_diffusers, "TRANSFORMER_KEYS_RENAME_DICT")
    assert ("self_attn", "attn1") in pairs and ("ffn.0", "ffn.net.0.proj") in pairs
    assert inverse_rename("blocks.3.attn1.to_q.weight", pairs) == "blocks.3.self_attn.q.weight"
    assert inverse_rename("blocks.3.norm2.weight", pairs) == "blocks.3.norm3.weight"  # the swap of norm2/norm3
    for key in ("blocks.3.attn1.to_q.weight", "blocks.3.norm2.weight", "condition_embedder.time_proj.weight"):
        assert forward_rename(inverse_rename(key, pairs), pairs) == key
    with pytest.raises(LayoutError, match="several original keys map to it .*head.modulation, modulation"):
        inverse_rename("scale_shift_table", pairs)  # Wan's head and blocks: the family resolves it
    with pytest.raises(LayoutError, match="assigns no literal dict"):
        diffusers_renames(convert_wan_transformer_to_diffusers, "NO_SUCH_DICT")


def test_row_map_places_fused_rows_and_permuted_halves():
    name = "flux"
    state = _tiny_state(name)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    rows = row_map(get_layout(name), shapes)
    h = shapes["transformer_blocks.0.attn.to_q.weight"][0]
    assert rows["transformer_blocks.0.attn.to_k.weight"].key == "double_blocks.0.img_attn.qkv.weight"
    assert rows["transformer_blocks.0.attn.to_k.weight"].rows.tolist() == list(range(h, 2 * h))
    assert rows["transformer_blocks.0.attn.to_k.weight"].total == 3 * h
    swapped = rows["norm_out.linear.weight"]  # [scale; shift] -> [shift; scale]
    half = swapped.total // 2
    assert swapped.rows.tolist() == list(range(half, 2 * half)) + list(range(half))
    assert len(rows) == len(shapes)
