"""Single-file checkpoints: tiny Flux and SD3 models written in their original release layouts load
offline, through the engine entry point the CLI uses, through `segckpt train` and through the node,
into models whose forward equals the diffusers model's; other families, unknown layouts and damaged
files are refused by name; the shipped variants are recognised from shapes alone.

The original layouts are written here with the published key mappings (Black Forest Labs' Flux.1
reference code, Stability AI's MMDiT), reversed from diffusers' conversion; each reverse mapping is
checked by round-tripping through diffusers' own forward conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from helpers import random_batch, verdict
from original_layouts import TO_ORIGINAL, flux_to_bfl, sd3_to_mmdit
from safetensors.torch import save_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.api import load_model
from segmented_checkpointing.engine.config import ConfigError, TrainConfig
from segmented_checkpointing.engine.families import family_names, get_family
from segmented_checkpointing.engine.files.checks import DamagedFileError
from segmented_checkpointing.engine.model.bundle import ModelLoadError, build_preset
from segmented_checkpointing.engine.model.layouts.flux import flux_original_to_diffusers
from segmented_checkpointing.engine.model.single_file import CONFIG_DIR, INFERRED, TINY, identify, model_shapes
from segmented_checkpointing.engine.train.checks import check_run
from segmented_checkpointing.engine.train.loop import train
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES

pytestmark = pytest.mark.usefixtures("offline")  # no network (tests/conftest.py)


# ------------------------------------------------------------------ helpers

def _tiny(family_name: str, **overrides):
    family = get_family(family_name)
    torch.manual_seed(3)
    return family.model_cls()(**{**family.tiny_config, **overrides}).eval()


def _prediction(family_name: str, model) -> torch.Tensor:
    family = get_family(family_name)
    latents, sigmas, text = random_batch(family, model)
    with torch.no_grad():
        return family.read_output(model, model(**family.make_inputs(model, latents, sigmas, text)), latents)


def _write(path: Path, family_name: str, model, *, full_checkpoint=False, dtype=None) -> Path:
    """``model`` as one .safetensors file in its original release layout (a full checkpoint: under
    ``model.diffusion_model.``, beside a VAE and a text encoder tensor)."""
    tensors = TO_ORIGINAL[family_name](model.state_dict())
    tensors = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in tensors.items()}
    if full_checkpoint:
        tensors = {f"model.diffusion_model.{k}": v for k, v in tensors.items()}
        tensors["first_stage_model.decoder.conv_in.weight"] = torch.zeros(4, 4, 3, 3)
        tensors["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.ones(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def _assert_same_forward(family_name, original, loaded):
    assert loaded.dtype == torch.float32
    torch.testing.assert_close(_prediction(family_name, loaded), _prediction(family_name, original),
                               atol=1e-5, rtol=0)


# ------------------------------------------------------------------ the reverse mappings are right

def test_sd3_reverse_mapping_round_trips_through_diffusers():
    model = _tiny("sd3")
    back = convert_sd3_transformer_checkpoint_to_diffusers(sd3_to_mmdit(model.state_dict()))
    want = model.state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


def test_flux_reverse_mapping_round_trips_through_diffusers_and_ours():
    # diffusers' Flux conversion hard-codes the released width (3072): keys and shapes at that width
    config = json.loads((CONFIG_DIR / "flux1-dev.json").read_text())
    with torch.device("meta"):
        dev = get_family("flux").model_cls().from_config({k: v for k, v in config.items() if k[0] != "_"})
    want = {k: v.shape for k, v in dev.state_dict().items()}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(flux_to_bfl(dev.state_dict()))
    ours = flux_original_to_diffusers(flux_to_bfl(dev.state_dict()))
    assert {k: v.shape for k, v in theirs.items()} == want == {k: v.shape for k, v in ours.items()}
    # values at the tiny width, through the engine's width-agnostic conversion
    model = _tiny("flux", guidance_embeds=True)
    back = flux_original_to_diffusers(flux_to_bfl(model.state_dict()))
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ loading, offline

@pytest.mark.parametrize("family_name", ["flux", "sd3"])
@pytest.mark.parametrize("full_checkpoint", [False, True], ids=["transformer", "full-checkpoint"])
def test_original_layout_file_loads_through_the_cli_entry_point(tmp_path, family_name, full_checkpoint):
    original = _tiny(family_name)
    path = _write(tmp_path / "model.safetensors", family_name, original, full_checkpoint=full_checkpoint)
    lines = []
    config = TrainConfig.create(family=family_name, model_file=str(path), base_model_precision="fp32")
    bundle = load_model(config, log=lines.append)
    assert bundle.family.name == family_name and bundle.vae is None and bundle.source == str(path)
    assert f"{family_name}, original layout, variant {TINY}" in lines[0]
    _assert_same_forward(family_name, original, bundle.transformer)


def test_diffusers_layout_file_loads_as_it_is(tmp_path):
    original = _tiny("flux")
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, str(tmp_path / "d.safetensors"))
    lines = []
    bundle = load_model(TrainConfig.create(model_file=str(tmp_path / "d.safetensors"), base_model_precision="fp32"),
                         log=lines.append)
    assert f"flux, diffusers layout, variant {TINY}" in lines[0]
    _assert_same_forward("flux", original, bundle.transformer)


@pytest.mark.parametrize("family_name, overrides", [
    ("flux", {"attention_head_dim": 128, "num_attention_heads": 1, "num_layers": 1, "num_single_layers": 2,
              "axes_dims_rope": (16, 56, 56), "guidance_embeds": True}),
    ("sd3", {"num_layers": 3, "dual_attention_layers": (1,)}),
    ("wan", {"attention_head_dim": 128, "num_attention_heads": 1, "num_layers": 2, "text_dim": 24, "ffn_dim": 48,
             "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads"}),
])
def test_a_file_of_no_shipped_variant_is_inferred_from_shapes(tmp_path, family_name, overrides):
    original = _tiny(family_name, **overrides)
    path = _write(tmp_path / "m.safetensors", family_name, original)
    lines = []
    bundle = load_model(TrainConfig.create(family=family_name, model_file=str(path), base_model_precision="fp32"),
                         log=lines.append)
    assert INFERRED in lines[0]
    _assert_same_forward(family_name, original, bundle.transformer)


def test_flux_head_width_without_a_known_rotary_split_is_refused(tmp_path):
    path = _write(tmp_path / "m.safetensors", "flux", _tiny("flux", num_layers=2))
    with pytest.raises(ModelLoadError) as info:
        load_model(TrainConfig.create(family="flux", model_file=str(path), base_model_precision="fp32"))
    text = str(info.value)
    assert "flux1-dev" in text and "flux1-schnell" in text and TINY in text and "axes_dims_rope" in text


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("base", ["bf16", "fp32"])
def test_stored_dtype_loads_into_the_base_precision(tmp_path, stored, base):
    original = _tiny("flux")
    path = _write(tmp_path / "m.safetensors", "flux", original, dtype=stored)
    bundle = load_model(TrainConfig.create(family="flux", model_file=str(path), base_model_precision=base))
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}[base]
    params = dict(bundle.transformer.named_parameters())
    assert {p.dtype for p in params.values()} == {want}
    expected = original.state_dict()["x_embedder.weight"].to(stored).to(want)
    assert torch.equal(params["x_embedder.weight"], expected)


def test_no_change_keeps_the_files_dtype(tmp_path):
    path = _write(tmp_path / "m.safetensors", "flux", _tiny("flux"), dtype=torch.bfloat16)
    bundle = load_model(TrainConfig.create(family="flux", model_file=str(path), base_model_precision="no_change"))
    assert bundle.transformer.x_embedder.weight.dtype == torch.bfloat16


def test_cli_trains_one_step_from_a_model_file_with_a_vae_folder(tmp_path, capsys):
    original = _tiny("flux")
    path = _write(tmp_path / "flux.safetensors", "flux", original)
    build_preset("flux").vae.save_pretrained(tmp_path / "vae")
    out = tmp_path / "out"
    argv = ["train", "--model-file", str(path), "--vae-path", str(tmp_path / "vae"), "--steps", "1",
            "--resolution", "64", "--base-precision", "fp32", "--device", "cpu", "--output", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "flux, original layout, variant tiny preset" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["model_file"] == str(path) and report["config"]["family"] == "flux"


def test_cli_without_a_vae_stops_naming_vae_path(tmp_path, capsys):
    path = _write(tmp_path / "flux.safetensors", "flux", _tiny("flux"))
    assert cli.main(["train", "--model-file", str(path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--vae-path" in err and err.count("\n") == 1


def test_sweep_without_a_vae_stops_before_loading(tmp_path, capsys):
    path = _write(tmp_path / "flux.safetensors", "flux", _tiny("flux"))
    assert cli.main(["sweep", "--model-file", str(path), "--output", str(tmp_path / "o")]) == 2
    assert "--vae-path" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_node_lists_and_loads_files_from_the_model_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    original = _tiny("sd3")
    _write(tmp_path / "models" / "diffusion_models" / "tiny-sd3.safetensors", "sd3", original)
    _write(tmp_path / "models" / "checkpoints" / "sub" / "full.safetensors", "sd3", original, full_checkpoint=True)
    node = NODES["SegCkptLoadDiffusionModel"]
    choices = node.INPUT_TYPES()["required"]["source"][1]["options"]
    assert {"diffusion_models/tiny-sd3.safetensors", "checkpoints/sub/full.safetensors"} <= set(choices)
    for source in ("diffusion_models/tiny-sd3.safetensors", "checkpoints/sub/full.safetensors"):
        assert node.validate_inputs(source=source) is True
        (model,) = node.execute("sd3", source, 0, "fp32")
        _assert_same_forward("sd3", original, model.load().transformer)
    for bad in ("diffusion_models/../../x.safetensors", "diffusion_models/missing.safetensors", "checkpoints/"):
        assert "source=" in verdict(node, source=bad)


def test_training_a_bundle_without_a_vae_stops_naming_vae_path(tmp_path):
    path = _write(tmp_path / "flux.safetensors", "flux", _tiny("flux"))
    bundle = load_model(TrainConfig.create(model_file=str(path), base_model_precision="fp32"))
    with pytest.raises(ModelLoadError, match="holds no VAE.*vae_path"):
        train(TrainConfig.create(output=str(tmp_path / "out"), steps=1), bundle=bundle, log=lambda line: None)


def test_node_leaves_out_links_that_lead_outside_the_model_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path / "comfy"))
    outside = _write(tmp_path / "elsewhere" / "x.safetensors", "flux", _tiny("flux"))
    (tmp_path / "comfy" / "models" / "unet").mkdir(parents=True)
    (tmp_path / "comfy" / "models" / "unet" / "link.safetensors").symlink_to(outside)
    node = NODES["SegCkptLoadDiffusionModel"]
    assert "diffusion_models/link.safetensors" not in node.INPUT_TYPES()["required"]["source"][1]["options"]
    assert "leads outside" in verdict(node, source="diffusion_models/link.safetensors")


# ------------------------------------------------------------------ refusals

def test_a_file_of_another_family_is_refused_naming_both(tmp_path, capsys):
    path = _write(tmp_path / "flux.safetensors", "flux", _tiny("flux"))
    with pytest.raises(ModelLoadError) as info:
        load_model(TrainConfig.create(family="sd3", model_file=str(path), base_model_precision="fp32"))
    assert "flux" in str(info.value) and "sd3" in str(info.value)
    (tmp_path / "vae").mkdir()
    assert cli.main(["train", "--model-file", str(path), "--family", "sd3", "--vae-path", str(tmp_path / "vae"),
                     "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "holds a flux transformer" in err and "sd3" in err


def test_a_file_of_unknown_layout_is_refused_naming_what_was_seen(tmp_path):
    path = tmp_path / "odd.safetensors"
    save_file({"encoder.layers.0.weight": torch.zeros(2, 2), "encoder.layers.1.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ModelLoadError, match=r"no known key layout: first keys encoder.layers.0.weight"):
        load_model(TrainConfig.create(model_file=str(path), base_model_precision="fp32"))
    with pytest.raises(ModelLoadError, match=r"no known key layout.*expected a sd3 file"):
        load_model(TrainConfig.create(family="sd3", model_file=str(path), base_model_precision="fp32"))


def test_a_recognised_family_without_single_file_support_is_named(tmp_path):
    path = tmp_path / "sana.safetensors"
    save_file({"blocks.0.cross_attn.q_linear.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ModelLoadError, match=r"holds a sana transformer .*not loaded here"):
        load_model(TrainConfig.create(family="sana", model_file=str(path), base_model_precision="fp32"))


def test_a_truncated_file_is_refused_before_any_model_is_built(tmp_path):
    path = _write(tmp_path / "m.safetensors", "flux", _tiny("flux"))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DamagedFileError, match=r"model_file .* is damaged"):
        check_run(TrainConfig.create(family="flux", model_file=str(path), vae_path=str(tmp_path)))


def test_model_path_and_model_file_are_exclusive(tmp_path):
    with pytest.raises(ConfigError, match=r"model_file=.*model_path.*give one"):
        TrainConfig.create(model_path=str(tmp_path), model_file="m.safetensors")
    with pytest.raises(ConfigError, match=r"model_file='m.ckpt' is invalid: allowed an existing .safetensors"):
        check_run(TrainConfig.create(model_file="m.ckpt"))


# ------------------------------------------------------------------ the shipped variants, from shapes

def _variants():
    for path in sorted(CONFIG_DIR.glob("*.json")):
        config = json.loads(path.read_text())
        family = next(f for f in family_names() if get_family(f).model_class == config["_class_name"])
        yield path.stem, family, {k: v for k, v in config.items() if not k.startswith("_")}


@pytest.mark.parametrize("variant, family_name, config", list(_variants()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_shipped_variants_are_recognised_from_shapes(variant, family_name, config):
    family = get_family(family_name)
    shapes = model_shapes(family, config)
    found = identify(shapes)
    assert (found.family.name, found.layout, found.variant) == (family_name, "diffusers", variant)
    if family_name in TO_ORIGINAL:  # the original layout too, on meta tensors
        meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
        original = {k: tuple(v.shape) for k, v in TO_ORIGINAL[family_name](meta).items()}
        found = identify(original, family_name)
        released = "diffusers" if original.keys() == shapes.keys() else "original"  # Qwen-Image: released so
        assert (found.layout, found.variant) == (released, variant)
