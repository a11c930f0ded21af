"""Model limits: each declared bound is what the diffusers model really takes, the resolution past it
is refused before any model is built, and bucketing leaves out (and counts) the buckets past it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import refuse_to_build_models
from PIL import Image

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.buckets import make_buckets, split_buckets
from segmented_checkpointing.engine.data.folder import DataWarning
from segmented_checkpointing.engine.data.limits import check_resolution, model_shape
from segmented_checkpointing.engine.families import TextBatch, get_family
from segmented_checkpointing.engine.families.limits import (
    Limits,
    full_config,
    largest_square,
    model_limits,
    token_patch,
)
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun, train


def _forward(family, model, rows: int, cols: int) -> None:
    """One no-grad forward of ``family``'s tiny ``model`` on a ``rows x cols`` token grid."""
    patch = token_patch(family, model.config)
    spec = family.text(model.config)
    size = (rows * patch, cols * patch)
    latents = torch.randn((1, family.latent_channels, 1, *size) if family.video_latents else
                          (1, family.latent_channels, *size))
    text = TextBatch(torch.randn(1, spec.max_length, spec.seq_dim), torch.ones(1, spec.max_length, dtype=torch.bool),
                     torch.randn(1, spec.pooled_dim) if spec.pooled_dim else None)
    with torch.no_grad():
        out = model(**family.make_inputs(model, latents, torch.rand(1), text))
    assert family.read_output(model, out, latents).shape == latents.shape


# (family, the grid side its tiny config's table gives, config overrides, probe a square or one row)
CASES = [
    ("sd3", 16, {}, "square"),  # pos_embed_max_size 16: PatchEmbed raises past it
    ("auraflow", 32, {}, "square"),  # sqrt(pos_embed_max_size 1024): IndexError past it (a row only wraps)
    ("wan", 32, {}, "row"),  # rope_max_seq_len 32: the view of the rotary table fails past it
    ("lumina2", 32, {}, "row"),  # axes_lens[2] 32: gather past the table
    ("kandinsky5", 128, {}, "row"),  # Kandinsky5RoPE3D max_pos 128, fixed in the class
]


@pytest.mark.parametrize(("name", "side", "overrides", "probe"), CASES, ids=[c[0] for c in CASES])
def test_the_declared_grid_is_what_diffusers_takes(name, side, overrides, probe):
    family = get_family(name)
    torch.manual_seed(0)
    model = family.model_cls()(**{**family.tiny_config, **overrides}).eval()
    limits = model_limits(family, dict(model.config))
    assert limits.grid == (side, side)
    # read before any model is built (the class's defaults filled in): the same limits
    assert model_limits(family, full_config(family.model_cls(), family.tiny_config)) == limits
    at, past = ((side, side), (side + 1, side + 1)) if probe == "square" else ((1, side), (1, side + 1))
    assert limits.fits(*at) and not limits.fits(*past)
    _forward(family, model, *at)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        _forward(family, model, *past)


def test_hidream_bounds_non_square_grids_only():
    family = get_family("hidream")
    torch.manual_seed(0)
    model = family.model_cls()(**{**family.tiny_config, "max_resolution": (16, 16)}).eval()  # max_seq 64 tokens
    limits = model_limits(family, dict(model.config))
    assert (limits.tokens, limits.square_tokens) == (64, False)
    assert limits.fits(1, 64) and not limits.fits(1, 65) and limits.fits(10, 10)
    _forward(family, model, 1, 64)
    _forward(family, model, 10, 10)  # 100 tokens: square latents are not padded to max_seq
    with pytest.raises(RuntimeError):
        _forward(family, model, 1, 65)


def test_families_without_a_table_declare_none_and_text_comes_from_the_encoders():
    flux = get_family("flux")
    assert flux.limits is None
    assert model_limits(flux, flux.tiny_config) == Limits(text=512)  # TextEncoders("t5", max_length=512)
    lumina = get_family("lumina2")  # axes_lens[0] 64 leaves 63 caption positions, under Gemma's 256
    assert model_limits(lumina, full_config(lumina.model_cls(), lumina.tiny_config)).text == 63


def test_largest_square():
    limits = Limits(grid=(16, 16), source="pos_embed_max_size 16")
    assert largest_square(limits, 2, 8, 8192) == 256
    assert largest_square(limits, 2, 8, 240) == 240
    assert largest_square(Limits(grid=(16, 16)), 1, 32, 8192) == 528  # a 32 px DC-AE: 528 // 32 = 16 cells
    assert largest_square(Limits(), 2, 8, 8192) == 8192


SD3_REFUSAL = ("resolution=272 is invalid for sd3 (tiny preset): allowed at most 256 (16x16 tokens "
               "(pos_embed_max_size 16) x patch 2 x VAE 8; the square is 17x17 tokens)")


def test_a_resolution_past_the_table_is_refused_before_any_model_is_built(monkeypatch, tmp_path):
    refuse_to_build_models(monkeypatch, "the resolution check")
    with pytest.raises(ConfigError) as err:
        TrainingRun(TrainConfig.create(family="sd3", resolution=272, output=str(tmp_path / "out")))
    assert str(err.value) == SD3_REFUSAL
    with pytest.raises(ConfigError, match="resolution=1024 is invalid for wan \\(tiny preset\\): allowed at most 512 "):
        TrainingRun(TrainConfig.create(family="wan", resolution=1024, buckets=True, output=str(tmp_path / "out")))
    largest, flux = TrainConfig.create(family="sd3", resolution=256), TrainConfig.create(family="flux", resolution=8192)
    assert check_resolution(largest.model, largest.data, None).grid == (16, 16)  # the largest passes
    assert check_resolution(flux.model, flux.data, None) == Limits(text=512)


def test_the_cli_refuses_in_one_line(capsys, tmp_path):
    from segmented_checkpointing import cli

    assert cli.main(["train", "--family", "sd3", "--resolution", "272", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"segckpt: error: {SD3_REFUSAL}"


def test_a_model_folder_s_config_is_read_without_loading_it(monkeypatch, tmp_path):
    bundle = build_preset("sd3", overrides={"pos_embed_max_size": 8})  # not the preset's 16: read from the file
    bundle.transformer.save_pretrained(tmp_path / "model" / "transformer")
    bundle.vae.save_pretrained(tmp_path / "model" / "vae")
    (tmp_path / "model" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    refuse_to_build_models(monkeypatch, "the resolution check")
    config = TrainConfig.create(family="sd3", model_path=str(tmp_path / "model"), resolution=144)
    shape = model_shape(config.model)
    assert (shape.config["pos_embed_max_size"], shape.downscale, shape.patch) == (8, 8, 2)
    with pytest.raises(ConfigError) as err:
        check_resolution(config.model, config.data, None)
    assert str(err.value) == (f"resolution=144 is invalid for sd3 (model_path {tmp_path / 'model'}): allowed at most "
                              "128 (8x8 tokens (pos_embed_max_size 8) x patch 2 x VAE 8; the square is 9x9 tokens)")


def test_buckets_past_the_grid_are_left_out_and_counted():
    candidates = make_buckets(256, 16)
    kept, left = split_buckets(candidates, Limits(grid=(16, 16)), 8, 2)
    assert [b.key for b in kept] == ["256x256"]
    assert len(left) == len(candidates) - 1 == 16 and "128x512" in [b.key for b in left]
    # rows <= 4, cols <= 5 tokens: 64x64 is 4x4, 80x48 is 3x5; 48x80 is 5x3, 32x128 8x2, 128x32 2x8
    kept, left = split_buckets(make_buckets(64, 16), Limits(grid=(4, 5)), 8, 2)
    assert [b.key for b in kept] == ["64x64", "80x48"] and [b.key for b in left] == ["32x128", "48x80", "128x32"]


def test_a_bucketed_run_reports_and_warns_what_it_left_out(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate([(256, 256), (512, 128)]):  # a square and a 4:1 image
        Image.new("RGB", size, (40 * i, 100, 200)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("a photo")
    config = TrainConfig.create(family="sd3", data=str(data), resolution=256, buckets=True, steps=1,
                                output=str(tmp_path / "out"), lora=LoraSettings(rank=2, alpha=2.0),
                                timing_warmup_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(config, log=lambda line: None)
    dataset = result.report["dataset"]
    assert [(b["bucket"], b["images"]) for b in dataset["buckets"]] == [("256x256", 2)]  # the 4:1 one went square
    left = dataset["buckets_left_out"]
    assert left["count"] == 16 and left["buckets"][0] == "128x512"
    assert left["limit"] == "16x16 tokens (pos_embed_max_size 16) x patch 2 x VAE 8"
    (warning,) = [w for w in caught if issubclass(w.category, DataWarning) and "left out" in str(w.message)]
    assert str(warning.message).startswith("buckets: 16 of 17 candidate buckets left out, past what sd3 takes")
