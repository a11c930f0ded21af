"""Dataset files as users have them: images of every mode as a viewer shows them, the files a
folder always holds besides images, kohya-style repeats folders, and a cache reused across runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from segmented_checkpointing.engine.data.folder import DatasetError, scan_dataset
from segmented_checkpointing.engine.data.images import BACKGROUND, load_image

ROOT = Path(__file__).resolve().parents[2]
GREEN = (0, 255, 0)


def _pixels(path: Path) -> np.ndarray:
    """The loader's 0-255 view of an image (8 px, no resampling of a flat image changes it)."""
    return np.round((load_image(path, 8).permute(1, 2, 0).numpy() + 1.0) * 127.5)


def _transparent(mode: str) -> Image.Image:
    if mode == "RGBA":
        return Image.new("RGBA", (64, 64), (*GREEN, 0))
    if mode == "LA":
        return Image.new("LA", (64, 64), (30, 0))
    image = Image.new("P", (64, 64), 0)
    image.putpalette([*GREEN, 255, 0, 0] + [0] * 762)
    image.info["transparency"] = 0
    return image


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_show_the_documented_background(tmp_path, mode):
    path = tmp_path / f"{mode}.png"
    image = _transparent(mode)
    image.save(path, transparency=0) if mode == "P" else image.save(path)
    assert (_pixels(path) == np.array(BACKGROUND)).all()


@pytest.mark.parametrize("mode, value, shown", [
    ("L", 100, 100), ("1", 1, 255), ("RGB", (10, 20, 30), (10, 20, 30)),
    ("I;16", 32768, 128), ("I;16", 65535, 255),  # 16 bits: the format's range, not the image's maximum
    ("CMYK", (0, 0, 0, 0), 255), ("F", 0.5, 128),
])
def test_every_mode_loads_with_the_brightness_a_viewer_shows(tmp_path, mode, value, shown):
    path = tmp_path / ("image.tif" if mode in ("CMYK", "F") else "image.png")
    Image.new(mode, (16, 16), value).save(path)
    assert (np.abs(_pixels(path) - np.array(shown)) <= 1).all(), (mode, _pixels(path)[0, 0])


def _jpeg(path: Path) -> None:
    Image.new("RGB", (32, 32), (200, 40, 40)).save(path)


def test_macos_companions_and_system_files_are_skipped_and_counted(tmp_path):
    for name in ("img0.jpg", "img1.jpg"):
        _jpeg(tmp_path / name)
    for name in ("._img0.jpg", "._img1.jpg", ".DS_Store", "Thumbs.db", "desktop.ini"):
        (tmp_path / name).write_bytes(b"\x00\x05\x16\x07 not an image")
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "__MACOSX").mkdir()
    scan = scan_dataset(tmp_path)
    assert [s.image.name for s in scan.samples] == ["img0.jpg", "img1.jpg"]
    assert scan.skipped == {"hidden or system files": 6, "other files": 1, "other folders": 0}


def test_kohya_repeats_folders_count_their_images_repeats_times(tmp_path):
    (tmp_path / "10_cat").mkdir()
    (tmp_path / "3_dog").mkdir()
    (tmp_path / "raw").mkdir()
    _jpeg(tmp_path / "10_cat" / "a.jpg")
    _jpeg(tmp_path / "10_cat" / "b.jpg")
    (tmp_path / "10_cat" / "b.txt").write_text("a cat")
    _jpeg(tmp_path / "3_dog" / "c.jpg")
    _jpeg(tmp_path / "raw" / "d.jpg")
    _jpeg(tmp_path / "top.jpg")
    scan = scan_dataset(tmp_path)
    assert [(s.image.name, s.repeats, s.caption) for s in scan.samples] == [
        ("top.jpg", 1, ""), ("a.jpg", 10, ""), ("b.jpg", 10, "a cat"), ("c.jpg", 3, "")]
    assert len(scan.epoch) == 1 + 10 + 10 + 3 and scan.ignored_folders == ["raw"]
    assert scan.summary()["repeats"] == {"10_cat": 10, "3_dog": 3}
    (tmp_path / "0_empty").mkdir()
    with pytest.raises(DatasetError, match="'0_empty' asks for 0 repeats: allowed 1 or more"):
        scan_dataset(tmp_path)


def test_a_folder_of_plain_subfolders_names_them(tmp_path):
    (tmp_path / "photos").mkdir()
    _jpeg(tmp_path / "photos" / "a.jpg")
    with pytest.raises(DatasetError, match="subfolders photos are not read .*<repeats>_<name>"):
        scan_dataset(tmp_path)


def _segckpt(*args, env=None):
    return subprocess.run([sys.executable, "-m", "segmented_checkpointing.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_training_on_a_folder_with_companions_reports_what_it_skipped_and_a_batch_larger_than_it(tmp_path):
    """The batch of 5 on 2 images (issue 34) is said in the log and counted in the report: each image
    appears 2.5 times in every batch."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("img0.jpg", "img1.jpg"):
        _jpeg(data / name)
        (data / f"._{name}").write_bytes(b"\x00\x05\x16\x07")
    out = tmp_path / "out"
    proc = _segckpt("train", "--data", str(data), "--steps", "1", "--resolution", "32", "--output", str(out),
                    "--batch-size", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "data: 2 images (2 per epoch)" in proc.stdout and "skipped 2 hidden or system files" in proc.stdout
    assert "data: batch_size=5 is larger than the 2 images of an epoch: each image appears 2.5 times in every " \
           "batch" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["dataset"]["skipped"]["hidden or system files"] == 2 and report["dataset"]["images"] == 2
    assert report["dataset"]["batch_over_data"] == {"batch_size": 5, "images_per_epoch": 2, "repeats_per_step": 2.5,
                                                    "largest_batch": 5}


def test_runs_in_processes_with_other_hash_seeds_reuse_one_cache_file(tmp_path):
    out = tmp_path / "out"
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = _segckpt("train", "--steps", "1", "--resolution", "32", "--output", str(out), "--overwrite", env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((out / "cache").glob("cache-*.safetensors"))) == 1
