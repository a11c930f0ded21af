"""Dataset folder: captions, unreadable files, centre crop, the sample photos, the sampler."""

from __future__ import annotations

import pytest
from PIL import Image

from segmented_checkpointing.engine.data.folder import SAMPLE_PHOTOS, DatasetError, scan_folder, write_sample_dataset
from segmented_checkpointing.engine.data.images import load_image
from segmented_checkpointing.engine.data.samplers import EpochSampler


def _image(path, size=(40, 20), color=(255, 0, 0)):
    Image.new("RGB", size, color).save(path)


def test_captions_and_missing_caption(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("  a red square \n")
    _image(tmp_path / "b.jpg")
    (tmp_path / "notes.md").write_text("not an image")
    samples = scan_folder(tmp_path)
    assert [(s.image.name, s.caption) for s in samples] == [("a.png", "a red square"), ("b.jpg", "")]


def test_unreadable_image_names_the_file(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (sample,) = scan_folder(tmp_path)
    with pytest.raises(DatasetError, match="broken.png"):
        load_image(sample.image, 32)


def test_empty_or_missing_folder(tmp_path):
    with pytest.raises(DatasetError, match="no image"):
        scan_folder(tmp_path)
    with pytest.raises(DatasetError, match="not a folder"):
        scan_folder(tmp_path / "missing")


def test_centre_crop_keeps_the_middle(tmp_path):
    image = Image.new("RGB", (60, 20), (0, 0, 255))
    image.paste((255, 255, 255), (20, 0, 40, 20))  # white middle third
    image.save(tmp_path / "wide.png")
    pixels = load_image(tmp_path / "wide.png", 16)
    assert pixels.shape == (3, 16, 16)
    assert pixels.min() > 0.9  # only the white middle survives the square centre crop
    assert -1.0 <= pixels.min() and pixels.max() <= 1.0


def test_sample_dataset_is_real_photographs(tmp_path):
    folder = write_sample_dataset(tmp_path / "samples")
    samples = scan_folder(folder)
    assert len(samples) == len(SAMPLE_PHOTOS)
    assert all(s.caption for s in samples)
    pixels = load_image(samples[0].image, 64)
    assert pixels.std() > 0.1  # a photograph, not a flat colour


def test_sampler_is_deterministic_and_resumable():
    a = EpochSampler(5, 2, seed=3)
    batches = [a.next_batch() for _ in range(6)]
    assert sorted(batches[0] + batches[1] + [batches[2][0]]) == list(range(5))
    b = EpochSampler(5, 2, seed=3)
    for _ in range(3):
        b.next_batch()
    c = EpochSampler(5, 2, seed=3, **b.state())
    assert [c.next_batch() for _ in range(3)] == batches[3:]
    assert EpochSampler(5, 2, seed=3).next_batch() == batches[0]
    assert EpochSampler(5, 2, seed=4).next_batch() != batches[0] or EpochSampler(5, 2, seed=5).next_batch() != batches[0]


def test_sixteen_bit_grey_png_is_scaled_not_clipped(tmp_path):
    import numpy as np

    ramp = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")  # mode I;16
    pixels = load_image(tmp_path / "deep.png", 32)
    assert -0.2 < pixels.mean() < 0.2 and pixels.min() < -0.9 and pixels.max() > 0.9
