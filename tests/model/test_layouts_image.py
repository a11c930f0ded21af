"""The released layouts of HiDream-I1, AuraFlow, Flux.2 and the SD 1.x / SDXL UNet
(engine/model/layouts): diffusers' conversion inverts them exactly, row by row; files written in
them from the tiny presets load offline through the engine entry point into models whose forward
equals the original's (the transformer alone and a full checkpoint); the shipped configs of the
released variants are recognised from shapes alone.

None of these conversions hard-codes a width (HiDream's is the identity, AuraFlow's and the UNet's
rename, Flux.2's splits its fused q, k, v in three equal parts), so no wrapper replaces one; the
released widths are checked on one-column row-tag probes instead: the shipped config's weights, as
unique row ids, go to the released layout and back through diffusers' conversion unchanged.

Checked by hand against ComfyUI 0.3.64's own models (``model_config_from_unet`` + ``get_model`` on
``meta``, or the model class built directly where detection hard-codes the released sizes): the key
names and shapes of every layout here equal ComfyUI's, none missing, none unexpected (Flux.2: ComfyUI
0.3.64 has no Flux.2 model). Small files ComfyUI's detection accepts, for a live test: an SD 1.x
UNet with ``block_out_channels (320, 640)``, ``layers_per_block 1``, cross-attention in the first
level, ``cross_attention_dim 768``, 1x1-conv projections (80M parameters, detected as ``SD15``); an
AuraFlow of width 3072 (12 heads of 256), ``joint_attention_dim 2048``, one joint and one single
block (548M, ``AuraFlow``: ComfyUI builds width 3072 whatever the file). HiDream is built at the
released size only (its detection reads no shape), and SDXL-shaped UNets are detected from the
released depth lists only (the smallest, KOALA-700M's, is 700M parameters).
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
from segmented_checkpointing.engine.model.bundle import ModelLoadError
from segmented_checkpointing.engine.model.layouts import get_layout, row_map
from segmented_checkpointing.engine.model.single_file import CONFIG_DIR, INFERRED, TINY, identify, model_shapes

FAMILIES = ("hidream", "auraflow", "flux2", "unet2dcondition")
SD15_TINY = {  # SD 1.x-shaped: cross-attention first, no pooled/time-ids embedding, 1x1-conv projections
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"), "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "transformer_layers_per_block": 1, "use_linear_projection": False, "addition_embed_type": None,
    "addition_time_embed_dim": None, "projection_class_embeddings_input_dim": None,
}
CASES = [(f, {}) for f in FAMILIES] + [("unet2dcondition", SD15_TINY)]
CASE_IDS = [*FAMILIES, "unet2dcondition-sd15"]


pytestmark = pytest.mark.usefixtures("offline")  # no network (tests/conftest.py)


def _tiny(family_name: str, **overrides):
    family = get_family(family_name)
    torch.manual_seed(3)
    return family.model_cls()(**{**family.tiny_config, **overrides}).eval()


def _from_original(family_name: str, checkpoint: dict, config) -> dict:
    layout = get_layout(family_name)
    return layout.from_original(checkpoint, dict(config)) if layout.needs_config else layout.from_original(checkpoint)


def _shipped(family_name: str):
    model_class = get_family(family_name).model_class
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        if data["_class_name"] == model_class:
            yield path.stem, {k: v for k, v in data.items() if not k.startswith("_")}


SHIPPED = [(f, name, config) for f in FAMILIES for name, config in _shipped(f)]


# ------------------------------------------------------------------ the layouts, both ways

@pytest.mark.parametrize("family_name, overrides", CASES, ids=CASE_IDS)
def test_diffusers_conversion_inverts_the_released_layout_exactly(family_name, overrides):
    model = _tiny(family_name, **overrides)
    want = model.state_dict()
    back = _from_original(family_name, get_layout(family_name).to_original(want), model.config)
    assert sorted(back) == sorted(want)
    for key, tensor in want.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("family_name, variant, config", SHIPPED, ids=[f"{f}-{v}" for f, v, _ in SHIPPED])
def test_released_width_row_tags_come_back_through_diffusers(family_name, variant, config):
    shapes = model_shapes(get_family(family_name), config)
    rows = {k: s[0] if s else 1 for k, s in shapes.items()}
    start, probe = 0, {}
    for key, shape in shapes.items():  # one column per tensor, row i of tensor n a number unique to (n, i)
        probe[key] = torch.arange(start, start + rows[key], dtype=torch.float64).reshape(
            (rows[key],) + (1,) * (len(shape) - 1)) if shape else torch.tensor(float(start))
        start += rows[key]
    original = get_layout(family_name).to_original(probe)
    back = _from_original(family_name, dict(original), config)
    assert sorted(back) == sorted(probe)
    assert all(torch.equal(back[k], probe[k]) for k in probe)
    assert len(row_map(get_layout(family_name), shapes)) == len(shapes)  # every weight in one original weight


def test_flux2_fused_weights_hold_q_k_v_in_order_and_the_final_modulation_swapped():
    model = _tiny("flux2")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    placed = row_map(get_layout("flux2"), shapes)
    inner = shapes["transformer_blocks.0.attn.to_q.weight"][0]
    for n, part in enumerate(("to_q", "to_k", "to_v")):
        where = placed[f"transformer_blocks.0.attn.{part}.weight"]
        assert where.key == "double_blocks.0.img_attn.qkv.weight" and where.total == 3 * inner
        assert torch.equal(where.rows, torch.arange(n * inner, (n + 1) * inner))
    assert placed["transformer_blocks.1.attn.add_v_proj.weight"].key == "double_blocks.1.txt_attn.qkv.weight"
    assert placed["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"].key == "single_blocks.0.linear1.weight"
    assert placed["transformer_blocks.0.attn.norm_q.weight"].key == "double_blocks.0.img_attn.norm.query_norm.scale"
    final = placed["norm_out.linear.weight"]
    assert final.key == "final_layer.adaLN_modulation.1.weight"
    assert torch.equal(final.rows, torch.arange(2 * inner).roll(inner))  # [scale; shift] -> [shift; scale]


def test_unet_lora_names_are_kohya_and_blocks_are_numbered_as_ldm():
    layout = get_layout("unet2dcondition")
    assert layout.lora_prefix == "lora_unet_"
    original = layout.to_original(_tiny("unet2dcondition").state_dict())
    for key in ("input_blocks.0.0.weight", "input_blocks.3.0.op.weight", "input_blocks.4.1.transformer_blocks.1.attn1.to_q.weight",
                "input_blocks.4.0.skip_connection.weight", "middle_block.1.proj_in.weight", "middle_block.2.emb_layers.1.weight",
                "output_blocks.2.2.conv.weight", "output_blocks.5.0.out_layers.3.weight", "label_emb.0.0.weight",
                "out.2.weight", "time_embed.0.weight"):
        assert key in original, key


# ------------------------------------------------------------------ single files, offline

def _prediction(family_name: str, model) -> torch.Tensor:
    family = get_family(family_name)
    latents, sigmas, text = random_batch(family, model)
    with torch.no_grad():
        return family.read_output(model, model(**family.make_inputs(model, latents, sigmas, text)), latents)


def _write(path: Path, family_name: str, model, full_checkpoint: bool) -> Path:
    """``model`` as one .safetensors file in its released layout (a full checkpoint: under
    ``model.diffusion_model.``, beside VAE and text-encoder tensors as SD / SDXL files hold them)."""
    tensors = {k: v.contiguous() for k, v in get_layout(family_name).to_original(model.state_dict()).items()}
    if full_checkpoint:
        tensors = {f"model.diffusion_model.{k}": v for k, v in tensors.items()}
        tensors["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4, 3, 3)
        tensors["cond_stage_model.transformer.text_model.final_layer_norm.weight"] = torch.ones(4)
        tensors["conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias"] = torch.ones(4)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("full_checkpoint", [False, True], ids=["transformer", "full-checkpoint"])
def test_released_layout_file_loads_with_the_same_forward(tmp_path, family_name, full_checkpoint):
    original = _tiny(family_name)
    path = _write(tmp_path / "model.safetensors", family_name, original, full_checkpoint)
    lines = []
    bundle = load_model(TrainConfig.create(family=family_name, model_file=str(path), base_model_precision="fp32"),
                        log=lines.append)
    layout = "diffusers" if family_name == "hidream" else "original"  # HiDream was released in diffusers' names
    assert bundle.family.name == family_name and f"{family_name}, {layout} layout, variant {TINY}" in lines[0]
    assert bundle.transformer.dtype == torch.float32
    torch.testing.assert_close(_prediction(family_name, bundle.transformer), _prediction(family_name, original),
                               atol=1e-5, rtol=0)


def test_a_flux2_file_is_not_taken_for_flux1():
    with torch.device("meta"):
        state = _tiny("flux2").state_dict()
    original = {k: tuple(v.shape) for k, v in get_layout("flux2").to_original(state).items()}
    assert "double_blocks.0.img_attn.norm.key_norm.scale" in original  # Flux.1's signature key
    assert identify(original).family.name == "flux2"
    with pytest.raises(ModelLoadError, match="holds a flux2 transformer"):
        identify(original, "flux")


# ------------------------------------------------------------------ the shipped variants, from shapes

@pytest.mark.parametrize("family_name, variant, config", SHIPPED, ids=[f"{f}-{v}" for f, v, _ in SHIPPED])
def test_shipped_variants_are_recognised_from_shapes(family_name, variant, config):
    shapes = model_shapes(get_family(family_name), config)
    found = identify(shapes)
    assert (found.family.name, found.layout, found.variant) == (family_name, "diffusers", variant)
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    original = {k: tuple(v.shape) for k, v in get_layout(family_name).to_original(meta).items()}
    found = identify(original, family_name)
    assert found.variant == variant and found.layout == ("diffusers" if family_name == "hidream" else "original")


def test_an_auraflow_file_of_another_position_table_is_inferred():
    config = dict(_shipped_config("auraflow-v0.3"), pos_embed_max_size=2304, num_single_dit_layers=2)
    shapes = model_shapes(get_family("auraflow"), config)
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    found = identify({k: tuple(v.shape) for k, v in get_layout("auraflow").to_original(meta).items()}, "auraflow")
    assert found.variant == INFERRED and found.config["pos_embed_max_size"] == 2304
    assert model_shapes(get_family("auraflow"), found.config) == shapes


def _shipped_config(variant: str) -> dict:
    data = json.loads((CONFIG_DIR / f"{variant}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}
