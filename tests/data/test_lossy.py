"""Nothing is dropped or clipped without a count: links not followed, images upscaled or skipped,
captions cut by the text encoder; and damaged data is refused before any model is built."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
from helpers import refuse_to_build_models, save_tiny_text_encoder
from PIL import Image

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.checks import check_dataset, fit_loss, screen_sizes
from segmented_checkpointing.engine.data.folder import DatasetError, DataWarning, scan_dataset
from segmented_checkpointing.engine.families import TextSpec, get_family
from segmented_checkpointing.engine.model.text_encoders import caption_overflow, load_text_encoders

QUIET = {"log": lambda line: None}


def _image(path, size=(32, 32)):
    Image.new("RGB", size, (30, 160, 90)).save(path)


def test_links_to_the_folder_above_or_to_a_folder_read_and_loops_are_counted_not_followed(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "elsewhere"
    (root / "2_sub").mkdir(parents=True)
    outside.mkdir()
    _image(root / "a.png")
    _image(root / "2_sub" / "b.png")
    _image(outside / "real.png")
    os.symlink(outside / "real.png", root / "ext.png")  # a file link: followed
    os.symlink(root, root / "5_self")  # the dataset again, five times
    os.symlink("..", root / "3_up")  # the folder above: everything, recursively
    os.symlink("2_sub", root / "4_dup")  # a folder already read
    os.symlink("loop2.png", root / "loop1.png")
    os.symlink("loop1.png", root / "loop2.png")
    os.symlink("missing.png", root / "gone.png")
    scan = scan_dataset(root)
    assert [(s.image.relative_to(root).as_posix(), s.repeats) for s in scan.samples] == [
        ("a.png", 1), ("ext.png", 1), ("2_sub/b.png", 2)]
    assert scan.lossy["link_not_followed"] == [
        "3_up (points at the dataset folder or above)", "4_dup (a folder already read)",
        "5_self (points at the dataset folder or above)", "gone.png (a broken link)", "loop1.png (a link loop)",
        "loop2.png (a link loop)"]
    summary = scan.summary()
    assert summary["images_per_epoch"] == 4
    assert summary["lossy"] == {"caption_truncated": 0, "image_upscaled": 0, "image_skipped": 0,
                                "link_not_followed": 6, "clip_truncated": 0, "clip_skipped": 0}
    assert summary["lossy_files"] == {"link_not_followed": scan.lossy["link_not_followed"][:5]}


def test_the_size_rule_counts_upscales_past_2x_and_skips_past_8x_or_8_to_1():
    assert fit_loss((32, 32), (64, 64)) is None  # exactly 2x: not counted
    assert fit_loss((30, 30), (64, 64)) == ("image_upscaled", "2.13x to 64x64")
    assert fit_loss((8, 8), (64, 64)) == ("image_upscaled", "8x to 64x64")
    assert fit_loss((1, 1), (64, 64)) == ("image_skipped", "1x1 px upscaled 64x to 64x64, more than 8x")
    assert fit_loss((10000, 10), (128, 32)) == ("image_skipped", "aspect 1000:1, more than 8:1")
    assert fit_loss((800, 100), (128, 32)) is None  # 8:1 is kept: a 4:1 bucket crops half of it away
    assert fit_loss((4000, 3000), (64, 64)) is None  # downscaling loses nothing the rule counts


@pytest.fixture(scope="module")
def lossy_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossy")
    data = root / "data"
    data.mkdir()
    _image(data / "ok1.png")
    (data / "ok1.txt").write_text(" ".join(f"word{i}" for i in range(20)))  # the stand-in reads 16 words
    _image(data / "ok2.png", (40, 24))
    (data / "ok2.txt").write_text("a green rectangle")
    _image(data / "small.png", (12, 12))  # 2.67x to 32x32
    _image(data / "tiny.png", (1, 1))
    _image(data / "strip.png", (10000, 10))
    os.symlink(data, data / "5_again")
    os.symlink("missing.png", data / "gone.png")
    return root


def test_a_run_counts_every_loss_in_the_report_and_warns_once_per_kind(lossy_data):
    config = TrainConfig.create(data=str(lossy_data / "data"), output=str(lossy_data / "out"), resolution=32, steps=1,
                                lora=LoraSettings(rank=4, alpha=4.0), timing_warmup_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = api.train(config, **QUIET)
    dataset = result.report["dataset"]
    assert dataset["images"] == 3 and dataset["images_per_epoch"] == 3
    assert dataset["lossy"] == {"caption_truncated": 1, "image_upscaled": 1, "image_skipped": 2,
                                "link_not_followed": 2, "clip_truncated": 0, "clip_skipped": 0}
    assert dataset["lossy_files"] == {
        "caption_truncated": ["ok1.png (caption: stand-in embedder: 20 words, reads 16)"],
        "image_upscaled": ["small.png (2.67x to 32x32)"],
        "image_skipped": ["strip.png (aspect 1000:1, more than 8:1)",
                          "tiny.png (1x1 px upscaled 32x to 32x32, more than 8x)"],
        "link_not_followed": ["5_again (points at the dataset folder or above)", "gone.png (a broken link)"]}
    data_warnings = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert [m.split(" (")[0] for m in data_warnings] == [
        "data: 1 captions longer than the text encoder reads were cut",
        "data: 1 images were upscaled more than 2x to their training size",
        "data: 2 images were skipped", "data: 2 links were not followed"]
    assert "strip.png (aspect 1000:1, more than 8:1); tiny.png" in data_warnings[2]


def test_a_folder_of_images_all_too_small_is_refused(tmp_path):
    _image(tmp_path / "dot.png", (1, 1))
    scan = check_dataset(tmp_path)
    with pytest.raises(DatasetError, match=r"every image is too small or too elongated to train \(1 skipped, e\.g\. "
                                           r"dot\.png \(1x1 px upscaled 64x"):
        screen_sizes(scan, [(64, 64)])


def test_the_real_tokenizers_count_the_captions_they_cut(tmp_path):
    """Flux: T5 reads 512 tokens, CLIP 77 (the word-level test tokenizer: one token per word)."""
    clip = save_tiny_text_encoder(tmp_path / "clip", "clip")
    t5 = save_tiny_text_encoder(tmp_path / "t5", "t5")
    encoders = load_text_encoders([clip, t5], get_family("flux"), TextSpec(32, 32))
    captions = ["a cat", " ".join(["a cat"] * 40), " ".join(["photo"] * 600)]
    assert caption_overflow(encoders, captions) == [None, "CLIP: 80 tokens, reads 77", "T5: 600 tokens, reads 512"]


def _noise_png(size=(64, 64)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_fake_or_truncated_image_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    refuse_to_build_models(monkeypatch, "the data was checked")
    data = tmp_path / "data"
    data.mkdir()
    _image(data / "good.png")
    (data / "x.png").write_text("not an image")
    config = TrainConfig.create(data=str(data), output=str(tmp_path / "out"), resolution=32, steps=1)
    with pytest.raises(DatasetError, match=r"^image '.*x\.png' could not be read: cannot identify image file"):
        api.train(config, **QUIET)
    (data / "x.png").write_bytes(_noise_png()[:6000])  # a PNG cut in half
    with pytest.raises(DatasetError, match=r"^image '.*x\.png' could not be read: .*[Tt]runcated"):
        api.train(config, **QUIET)
    buffer = io.BytesIO()
    Image.open(io.BytesIO(_noise_png())).save(buffer, "JPEG")
    (data / "x.png").unlink()
    (data / "y.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(DatasetError, match=r"^image '.*y\.jpg' could not be read: .*[Tt]runcated"):
        api.train(config, **QUIET)
    (data / "y.jpg").unlink()
    (data / "good.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DatasetError, match=r"^caption '.*good\.txt' is not UTF-8 text: byte 3"):
        api.train(config, **QUIET)
    assert not (tmp_path / "out").exists()  # nothing was written either
