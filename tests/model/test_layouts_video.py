"""The released layouts of HunyuanVideo, LTX-Video, Cosmos Predict 2 and Wan VACE
(``engine/model/layouts``): both ways exact, faithful to ComfyUI's own models, and their single
files load offline.

- every family's tiny preset survives ``from_original(to_original(sd))`` tensor by tensor;
- HunyuanVideo's ``linear1`` split (diffusers hard-codes width 3072) equals diffusers' own at the
  released width: shapes on ``meta``, values on one-column row-id probes (no full-size tensor);
- a tiny model written in the released layout loads through ``load_model`` (transformer only and
  full checkpoint, and in the diffusers layout; HunyuanVideo in Tencent's names too, Cosmos with
  NVIDIA's ``net.`` prefix and buffers) and predicts what the original model predicts;
- every shipped variant config is recognised from shapes alone, in both layouts;
- at :data:`SMALL` (configs ComfyUI detects and builds at the widths it assumes), the released
  layout has exactly the keys and shapes of ComfyUI's model (``comfyui_video_models.json``,
  written by ``tests/live/comfy_model_keys.py`` with ComfyUI 0.3.64; ``test_comfyui_layouts_video.py``
  checks it against a live ComfyUI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import random_batch
from safetensors.torch import save_file

from segmented_checkpointing.engine.api import load_model
from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.layouts import diffusers_converter, get_layout, row_map
from segmented_checkpointing.engine.model.layouts import hunyuanvideo as hv
from segmented_checkpointing.engine.model.single_file import CONFIG_DIR, TINY, identify

FAMILIES = ("hunyuanvideo", "ltxvideo", "cosmos", "wanvace")
SNAPSHOT = Path(__file__).with_name("comfyui_video_models.json")

SMALL = {  # overrides of the tiny presets: widths ComfyUI's detection assumes, so its model has our shapes
    # hidden = heads x 128, rotary axes (16, 56, 56), MLP ratio 4, two refiner blocks, pooled CLIP 768
    "hunyuanvideo": {"num_attention_heads": 1, "attention_head_dim": 128, "num_layers": 1, "num_single_layers": 1,
                     "num_refiner_layers": 2, "mlp_ratio": 4.0, "pooled_projection_dim": 768,
                     "rope_axes_dim": (16, 56, 56)},
    # 32 heads, caption width 4096, cross-attention width = hidden
    "ltxvideo": {"num_attention_heads": 32, "attention_head_dim": 4, "cross_attention_dim": 128,
                 "caption_channels": 4096, "num_layers": 2},
    # Predict 2: 16 heads and 10 blocks (ComfyUI's defaults off the released widths), text 1024,
    # AdaLN-LoRA 256, the padding-mask channel, no learnable position embedding
    "cosmos": {"num_attention_heads": 16, "attention_head_dim": 16, "num_layers": 10, "mlp_ratio": 4.0,
               "text_embed_dim": 1024, "adaln_lora_dim": 256, "concat_padding_mask": True,
               "extra_pos_embed_type": None},
    # heads of 128, frequency width 256, text 4096, a VACE block every num_layers / vace blocks
    "wanvace": {"num_attention_heads": 1, "attention_head_dim": 128, "freq_dim": 256, "text_dim": 4096,
                "num_layers": 4, "vace_layers": (0, 2)},
}


pytestmark = pytest.mark.usefixtures("offline")  # no network (tests/conftest.py)


def _tiny(family_name: str):
    family = get_family(family_name)
    torch.manual_seed(3)
    return family.model_cls()(**family.tiny_config).eval()


def _meta_state(family_name: str, config: dict) -> dict[str, torch.Tensor]:
    family = get_family(family_name)
    with torch.device("meta"):
        return dict(family.model_cls().from_config(config).state_dict())


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shapes(state: dict) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _released(name: str) -> dict:
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    return {k: v for k, v in config.items() if not k.startswith("_")}


# ------------------------------------------------------------------ both ways, exactly

@pytest.mark.parametrize("family_name", FAMILIES)
def test_released_layout_round_trips_through_diffusers_conversion(family_name):
    layout = get_layout(family_name)
    state = _tiny(family_name).state_dict()
    original = layout.to_original(state)
    assert _same(layout.from_original(dict(original)), state)
    places = row_map(layout, _shapes(state))  # every diffusers weight lands, whole, in one released weight
    assert places.keys() == state.keys()


def test_hunyuanvideo_converts_tencents_names_and_comfyuis():
    state = _tiny("hunyuanvideo").state_dict()
    tencent, comfy = hv.hunyuanvideo_to_released(state), hv.hunyuanvideo_to_original(state)
    assert "double_blocks.0.img_attn_qkv.weight" in tencent and "double_blocks.0.img_attn.qkv.weight" in comfy
    assert _same(hv.hunyuanvideo_from_original(dict(tencent)), state)
    assert _same(hv.comfyui_to_released(comfy), tencent)
    assert _same(hv.comfyui_to_released(tencent), tencent)


def test_cosmos_converts_nvidias_files_prefix_and_buffers_included():
    layout, state = get_layout("cosmos"), _tiny("cosmos").state_dict()
    released = {f"net.{k}": v for k, v in layout.to_original(state).items()}
    assert "net.extra_pos_embedder.pos_emb_h" in released
    released |= {"net.pos_embedder.dim_spatial_range": torch.zeros(4), "net.accum_iteration": torch.zeros(()),
                 "net.blocks.0.self_attn.output_proj._extra_state": torch.zeros(1)}
    assert _same(layout.from_original(released), state)


def test_hunyuanvideo_linear1_split_equals_diffusers_at_the_released_width():
    convert = diffusers_converter("HunyuanVideoTransformer3DModel")
    meta = _meta_state("hunyuanvideo", _released("hunyuanvideo-t2v-720p"))
    assert meta["single_transformer_blocks.0.attn.to_q.weight"].shape[0] == hv.RELEASED_WIDTH
    want = _shapes(meta)
    assert _shapes(convert(hv.hunyuanvideo_to_released(meta))) == want
    assert _shapes(hv.hunyuanvideo_from_original(hv.hunyuanvideo_to_released(meta))) == want
    assert _shapes(hv.hunyuanvideo_from_original(hv.hunyuanvideo_to_original(meta))) == want
    # values: each row of each tensor holds its own id (one column: the rows of the released model only)
    probe, start = {}, 0
    for key, shape in want.items():
        probe[key] = torch.arange(start, start + shape[0], dtype=torch.float64).reshape((shape[0],) + (1,) * (len(shape) - 1))
        start += shape[0]
    theirs = convert(hv.hunyuanvideo_to_released(probe))
    assert _same(theirs, probe)
    assert _same(hv.hunyuanvideo_from_original(hv.hunyuanvideo_to_released(probe)), theirs)
    assert _same(hv.hunyuanvideo_from_original(hv.hunyuanvideo_to_original(probe)), theirs)
    # at another width diffusers' own split fails, hence the wrapper
    with pytest.raises(RuntimeError, match="split"):
        convert(hv.hunyuanvideo_to_released(_tiny("hunyuanvideo").state_dict()))


# ------------------------------------------------------------------ single files, offline

def _prediction(family_name: str, model) -> torch.Tensor:
    family = get_family(family_name)
    latents, sigmas, text = random_batch(family, model)
    with torch.no_grad():
        return family.read_output(model, model(**family.make_inputs(model, latents, sigmas, text)), latents)


def _write(path: Path, state: dict, full_checkpoint: bool) -> Path:
    tensors = {k: v.contiguous() for k, v in state.items()}
    if full_checkpoint:
        tensors = {f"model.diffusion_model.{k}": v for k, v in tensors.items()}
        tensors["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4, 3, 3)
        tensors["text_encoders.t5xxl.transformer.shared.weight"] = torch.ones(4, 2)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("layout, full_checkpoint", [("original", False), ("original", True), ("diffusers", False)],
                         ids=["original", "original-full-checkpoint", "diffusers"])
def test_single_file_loads_offline_with_the_same_forward(tmp_path, family_name, layout, full_checkpoint):
    original = _tiny(family_name)
    state = original.state_dict()
    if layout == "original":
        state = get_layout(family_name).to_original(state)
    path = _write(tmp_path / "model.safetensors", state, full_checkpoint)
    lines = []
    bundle = load_model(TrainConfig.create(family=family_name, model_file=str(path), base_model_precision="fp32"),
                        log=lines.append)
    assert bundle.family.name == family_name and bundle.transformer.dtype == torch.float32
    assert f"{family_name}, {layout} layout, variant {TINY}" in lines[0]
    torch.testing.assert_close(_prediction(family_name, bundle.transformer), _prediction(family_name, original),
                               atol=1e-5, rtol=0)


def test_hunyuanvideo_file_in_tencents_names_loads(tmp_path):
    original = _tiny("hunyuanvideo")
    path = _write(tmp_path / "model.safetensors", hv.hunyuanvideo_to_released(original.state_dict()), True)
    bundle = load_model(TrainConfig.create(family="hunyuanvideo", model_file=str(path), base_model_precision="fp32"))
    torch.testing.assert_close(_prediction("hunyuanvideo", bundle.transformer), _prediction("hunyuanvideo", original),
                               atol=1e-5, rtol=0)


# ------------------------------------------------------------------ shipped variants, from shapes

def _variants():
    classes = {get_family(f).model_class: f for f in FAMILIES}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        config = json.loads(path.read_text())
        if config["_class_name"] in classes:
            yield path.stem, classes[config["_class_name"]], {k: v for k, v in config.items() if not k.startswith("_")}


VARIANTS = list(_variants())


@pytest.fixture(scope="module")
def cached_shapes():
    """``identify`` builds every variant's model on meta for each file; build each once here."""
    from segmented_checkpointing.engine.model import single_file

    built, real = {}, single_file.model_shapes

    def shapes(family, config):
        key = (family.name, json.dumps(config, sort_keys=True, default=list))
        if key not in built:
            built[key] = real(family, config)
        return dict(built[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(single_file, "model_shapes", shapes)
        yield shapes


def test_every_family_ships_variants():
    assert {family for _, family, _ in VARIANTS} == set(FAMILIES)


@pytest.mark.parametrize("variant, family_name, config", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_shipped_variants_are_recognised_from_shapes(cached_shapes, variant, family_name, config):
    shapes = cached_shapes(get_family(family_name), config)
    found = identify(shapes)
    assert (found.family.name, found.layout, found.variant) == (family_name, "diffusers", variant)
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    found = identify(_shapes(get_layout(family_name).to_original(meta)))
    assert (found.family.name, found.layout, found.variant) == (family_name, "original", variant)


# ------------------------------------------------------------------ ComfyUI's own names

@pytest.mark.parametrize("family_name", FAMILIES)
def test_released_layout_is_comfyuis_model(family_name):
    snapshot = json.loads(SNAPSHOT.read_text())[family_name]
    assert snapshot["config"] == json.loads(json.dumps(SMALL[family_name]))
    state = _meta_state(family_name, {**get_family(family_name).tiny_config, **SMALL[family_name]})
    original = get_layout(family_name).to_original(state)
    assert {k: list(s) for k, s in _shapes(original).items()} == snapshot["state"]
    if family_name == "hunyuanvideo":  # Tencent's names become ComfyUI's as ComfyUI loads them
        assert sorted(hv.hunyuanvideo_to_released(state)) != sorted(original)
        assert snapshot["released_renamed"] == sorted(original)
