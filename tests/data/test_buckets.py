"""Aspect-ratio buckets: the geometry, the cache format, batches of one bucket, resume, the report, every family."""

from __future__ import annotations

import json
import math

import diffusers
import pytest
import torch
from helpers import full_and_resumed
from PIL import Image
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.buckets import (
    Bucket,
    latent_multiple,
    latents_for,
    make_buckets,
    nearest_bucket,
    pixel_multiple,
    sample_latent_shape,
    shape_classes,
    stack_latents,
    token_patch,
    vae_downscale,
)
from segmented_checkpointing.engine.data.cache import assign_buckets
from segmented_checkpointing.engine.data.comfy_data import PreparedData
from segmented_checkpointing.engine.data.folder import scan_folder
from segmented_checkpointing.engine.data.images import image_size, load_image
from segmented_checkpointing.engine.data.samplers import BucketSampler
from segmented_checkpointing.engine.families import family_names, get_family
from segmented_checkpointing.engine.model.bundle import build_preset, tiny_vae
from segmented_checkpointing.engine.train import step as step_module
from segmented_checkpointing.engine.train.checks import check_run
from segmented_checkpointing.engine.train.loop import TrainingRun, train
from segmented_checkpointing.engine.train.state import load_state, save_state

QUIET = {"log": lambda line: None}
# three aspect ratios: 3 wide (3:2), 2 tall (2:3), 2 square; flux's tiny preset: VAE 8 x 2x2 packing = 16 px
SIZES = [(96, 64)] * 3 + [(64, 96)] * 2 + [(64, 64)] * 2


def _write(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (30 * i, 120, 220 - 25 * i)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"photo number {i}")
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A run root holding ``data/`` (:data:`SIZES`); each run writes its own output folder beside it."""
    return _write(tmp_path_factory.mktemp("buckets") / "data", SIZES).parent


def _config(root, name, **changes):
    base = TrainConfig.create(output=str(root / name), data=str(root / "data"), resolution=64, steps=8, batch_size=2,
                       buckets=True, lora=LoraSettings(rank=4, alpha=4.0), timing_warmup_steps=0)
    return base.replace(**changes)


def _recorded_run(monkeypatch, config):
    """Train ``config``; the cache rows of every micro-batch the step read, and the run's cache."""
    drawn, seen = [], {}

    def recording(cache, rows):
        drawn.append(list(rows))
        seen["cache"] = cache
        return latents_for(cache, rows)

    monkeypatch.setattr(step_module, "latents_for", recording)
    result = train(config, **QUIET)
    return drawn, seen["cache"], result


# ---- geometry ---------------------------------------------------------------------------------

def test_buckets_keep_the_area_in_multiples_within_one_to_four():
    assert [b.key for b in make_buckets(64, 16)] == ["32x128", "48x80", "64x64", "80x48", "128x32"]
    sdxl = ["512x2048", "576x1792", "640x1600", "704x1472", "768x1344", "832x1216", "896x1152", "960x1088",
            "1024x1024", "1088x960", "1152x896", "1216x832", "1344x768", "1472x704", "1600x640", "1792x576",
            "2048x512"]
    assert [b.key for b in make_buckets(1024, 64)] == sdxl  # the familiar SDXL list
    assert [b.key for b in make_buckets(48, 32)] == ["32x32", "32x64", "64x32"]  # the rounded-down square is kept
    assert Bucket(768, 1344).latent_hw(8) == (168, 96)
    with pytest.raises(ConfigError, match="resolution=16 .* at least 32"):
        make_buckets(16, 32)


def test_nearest_aspect_ratio_in_log_space_and_ties_are_deterministic():
    buckets = make_buckets(64, 16)
    assert [nearest_bucket(s, buckets).key for s in [(96, 64), (64, 96), (64, 64), (1000, 10)]] == [
        "80x48", "48x80", "64x64", "128x32"]
    pair = [Bucket(64, 32), Bucket(32, 64)]  # 1:1 is as far from 2:1 as from 1:2: the wider wins, in any order
    assert nearest_bucket((48, 48), pair) == nearest_bucket((48, 48), pair[::-1]) == Bucket(64, 32)


def test_exif_rotation_counts_in_the_size_and_the_crop_fills_the_bucket(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 96x64, shown 64x96
    Image.new("RGB", (96, 64), (0, 0, 255)).save(tmp_path / "turned.jpg", exif=exif)
    assert image_size(tmp_path / "turned.jpg") == (64, 96)
    assert load_image(tmp_path / "turned.jpg", (48, 80)).shape == (3, 80, 48)
    assert torch.equal(load_image(tmp_path / "turned.jpg", 32), load_image(tmp_path / "turned.jpg", (32, 32)))


def test_three_aspect_ratios_give_three_buckets(data_dir):
    buckets = assign_buckets(scan_folder(data_dir / "data"), 64, 16)
    assert [b.key for b in buckets] == ["80x48"] * 3 + ["48x80"] * 2 + ["64x64"] * 2


def test_pixel_multiple_is_the_vae_downscale_times_the_patch():
    wan_vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True])
    ltx_vae = diffusers.AutoencoderKLLTXVideo(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                              layers_per_block=(1, 1, 1, 1, 1),
                                              decoder_layers_per_block=(1, 1, 1, 1, 1), latent_channels=4)
    assert (vae_downscale(wan_vae), vae_downscale(ltx_vae)) == (8, 32)  # LTX: config null, the VAE computes 32
    expected = {"flux": (16, 2), "qwenimage": (16, 2), "qwenimage21": (16, 1), "wan": (16, 2), "sana": (8, 1),
                "unet2dcondition": (8, 1), "zimage": (16, 2), "sd3": (16, 2)}
    for name, (multiple, patch) in expected.items():
        bundle = build_preset(name)
        got = (pixel_multiple(bundle.family, bundle.transformer.config, bundle.vae),
               token_patch(bundle.family, bundle.transformer.config))
        assert got == (multiple, patch), name


# ---- the cache format -------------------------------------------------------------------------

def test_cache_stores_latents_per_bucket_and_one_shape_stays_plain():
    a, b, c = torch.full((1, 2, 3, 5), 1.0), torch.full((1, 2, 4, 4), 2.0), torch.full((1, 2, 3, 5), 3.0)
    cache = stack_latents([a, b, c], ["40x24", "32x32", "40x24"])
    assert sorted(cache) == ["bucket_index", "bucket_row", "latents.32x32", "latents.40x24"]
    assert cache["bucket_index"].tolist() == [1, 0, 1] and cache["bucket_row"].tolist() == [0, 0, 1]
    assert torch.equal(latents_for(cache, [2, 0]), torch.cat([c, a]))
    with pytest.raises(ValueError, match=r"rows \[0, 1\] span buckets 32x32, 40x24"):
        latents_for(cache, [0, 1])
    assert shape_classes(cache) == [((2, 4, 4), [1]), ((2, 3, 5), [0, 2])]  # largest first
    assert sample_latent_shape(cache) == (2, 3, 5)  # the most common
    plain = stack_latents([a, c], ["40x24", "40x24"])
    assert list(plain) == ["latents"] and shape_classes(plain) == [((2, 3, 5), [0, 1])]


# ---- batches ----------------------------------------------------------------------------------

def test_sampler_never_mixes_buckets_keeps_short_batches_and_resumes():
    groups = [[0, 1, 2], [3, 4], [5]]
    sampler = BucketSampler(groups, 2, seed=3)
    drawn = [sampler.next_batch() for _ in range(8)]  # 4 batches per epoch: 2 + 1, 2, 1
    for epoch in (drawn[:4], drawn[4:]):
        assert sorted(p for batch in epoch for p in batch) == list(range(6))
        assert sorted(len(batch) for batch in epoch) == [1, 1, 2, 2]
    assert all(any(set(batch) <= set(g) for g in groups) for batch in drawn)
    assert sampler.state() == {"epoch": 1, "index": 4}
    again = BucketSampler(groups, 2, seed=3)
    assert [again.next_batch() for _ in range(8)] == drawn
    resumed = BucketSampler(groups, 2, seed=3, epoch=0, index=3)
    assert [resumed.next_batch() for _ in range(5)] == drawn[3:]
    other = BucketSampler(groups, 2, seed=4)
    assert [other.next_batch() for _ in range(8)] != drawn


def test_a_run_never_mixes_buckets_and_its_order_follows_the_seed(data_dir, monkeypatch):
    drawn, cache, _ = _recorded_run(monkeypatch, _config(data_dir, "order"))
    assert len(drawn) == 8
    index = cache["bucket_index"]
    assert all(len(set(index[rows].tolist())) == 1 for rows in drawn)  # no mixed batch
    for epoch in (drawn[:4], drawn[4:]):  # 4 batches per epoch: the 3 wide images in a batch of 2 and one of 1
        assert sorted(r for rows in epoch for r in rows) == list(range(7))
        assert sorted(len(rows) for rows in epoch) == [1, 2, 2, 2]
    same, _, _ = _recorded_run(monkeypatch, _config(data_dir, "order-again"))
    other, _, _ = _recorded_run(monkeypatch, _config(data_dir, "order-seed1", seed=1))
    assert same == drawn and other != drawn


def test_resume_with_buckets_equals_an_uninterrupted_run(data_dir):
    """Batches of 3: 3 per epoch (the tall and square buckets give short ones); the stop falls in epoch 1."""
    full, second = full_and_resumed(lambda name, **changes: _config(data_dir, name, batch_size=3, **changes), 4,
                                    **QUIET)
    a, b = load_file(full.lora_path), load_file(second.lora_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in full.history] == [h["loss"] for h in second.history]


# ---- the report and the refusals -------------------------------------------------------------

def test_the_report_and_the_log_list_the_buckets(data_dir):
    lines = []
    result = train(_config(data_dir, "report", steps=1), log=lines.append)
    assert json.loads(result.report_path.read_text())["dataset"]["buckets"] == [
        {"bucket": "64x64", "width": 64, "height": 64, "images": 2, "images_per_epoch": 2, "image_tokens": 16},
        {"bucket": "48x80", "width": 48, "height": 80, "images": 2, "images_per_epoch": 2, "image_tokens": 15},
        {"bucket": "80x48", "width": 80, "height": 48, "images": 3, "images_per_epoch": 3, "image_tokens": 15},
    ]
    assert ("buckets: 64x64 (2 images, 16 tokens), 48x80 (2 images, 15 tokens), 80x48 (3 images, 15 tokens); "
            "sides in multiples of 16 px") in lines
    cache = load_file(next((data_dir / "report" / "cache").glob("cache-*.safetensors")))
    assert {k for k in cache if k.startswith("latents")} == {"latents.48x80", "latents.64x64", "latents.80x48"}
    assert cache["latents.80x48"].shape == (3, 16, 6, 10)


def test_buckets_are_refused_where_they_cannot_apply(tmp_path):
    with pytest.raises(ConfigError, match="buckets=True is invalid: allowed false for family 'acestep'"):
        TrainConfig.create(family="acestep", buckets=True)
    with pytest.raises(ConfigError, match="buckets='yes' is invalid: allowed true or false"):
        TrainConfig.create(buckets="yes")
    prepared = PreparedData("flux", {}, {})  # refused before the data is looked at
    with pytest.raises(ConfigError, match="buckets=True is invalid with prepared data"):
        TrainingRun(TrainConfig.create(output=str(tmp_path / "out"), buckets=True), prepared=prepared)


def test_resume_keeps_buckets_and_a_state_from_before_the_option_ran_without(data_dir):
    """A state saved before ``buckets`` existed has no such key: it ran without buckets."""
    train(_config(data_dir, "old", steps=1, buckets=False), **QUIET)
    output = data_dir / "old"
    state = load_state(output)
    del state.config["buckets"]
    save_state(state, output)
    check_run(_config(data_dir, "old", steps=2, buckets=False, resume=True))
    with pytest.raises(ConfigError, match="resume: buckets=True differs from the saved run's False"):
        check_run(_config(data_dir, "old", steps=2, resume=True))


# ---- every family -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("wide") / "data", [(96, 48)])


@pytest.mark.parametrize("family", [f for f in family_names() if get_family(f).aspect_buckets])
def test_every_family_trains_a_step_on_a_non_square_bucket(family, wide_dir):
    result = train(TrainConfig.create(family=family, output=str(wide_dir.parent / family), data=str(wide_dir), steps=1,
                               resolution=48, buckets=True, lora=LoraSettings(rank=2, alpha=2.0),
                               timing_warmup_steps=0), **QUIET)
    (bucket,) = result.report["dataset"]["buckets"]
    # 2:1 at 48 px: 64x32 in multiples of 16 or 32 (LTX-Video's 32x VAE), 72x32 in multiples of 8
    with torch.device("meta"):
        downscale = vae_downscale(tiny_vae(get_family(family)))
    multiple = downscale * latent_multiple(get_family(family), result.model.config)
    assert (bucket["width"], bucket["height"]) == {16: (64, 32), 8: (72, 32), 32: (64, 32)}[multiple]
    assert math.isfinite(result.history[0]["loss"])
