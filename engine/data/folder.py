"""A dataset folder: images with same-name ``.txt`` captions, and the built-in sample photos.

A dataset folder holds images directly, and/or kohya-style ``<repeats>_<name>`` subfolders whose
images count ``repeats`` times per epoch; hidden and system files (``._*`` macOS companions,
``.DS_Store``, ``Thumbs.db``, ``desktop.ini``, any dot-file) are skipped and counted. The
built-in default writes real photographs from scikit-image.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from ..files.atomic import atomic_write_bytes, atomic_write_text

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
SAMPLE_PHOTOS = {
    "astronaut": "a portrait photo of an astronaut in a white spacesuit in front of the flag",
    "coffee": "a cup of coffee with latte art on a saucer, top view",
    "chelsea": "a ginger tabby cat looking to the side",
    "rocket": "a rocket on the launch pad against a blue sky",
    "hubble_deep_field": "deep space photo full of distant galaxies",
    "camera": "a black and white photo of a cameraman with a tripod",
}
"""The built-in sample photographs (``skimage.data`` names) and their captions."""


class DatasetError(ValueError):
    """The dataset folder or one of its files cannot be used; the message names it."""


class DataWarning(UserWarning):
    """Something about the data was repaired or left out; the message says what."""


@dataclass(frozen=True)
class Sample:
    """One training example: an image file, its caption (empty when no ``.txt`` exists) and how
    many times it counts per epoch (a kohya-style ``<repeats>_<name>`` subfolder's repeats)."""

    image: Path
    caption: str
    repeats: int = 1


def write_sample_dataset(folder: str | Path) -> Path:
    """Write the built-in sample photographs with captions into ``folder`` (idempotent, atomic)."""
    import skimage.data

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, caption in SAMPLE_PHOTOS.items():
        path = folder / f"{name}.png"
        if not path.exists():
            buffer = io.BytesIO()
            Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(buffer, format="PNG")
            atomic_write_text(folder / f"{name}.txt", caption + "\n")
            atomic_write_bytes(path, buffer.getvalue())
    return folder


HIDDEN_NAMES = ("thumbs.db", "ehthumbs.db", "desktop.ini", "icon\r")
"""System files that are never data (compared case-insensitively), besides every dot-file."""
REPEATS_FOLDER = re.compile(r"^(\d+)_(.+)$")
"""kohya's sd-scripts layout: ``<repeats>_<name>`` subfolders."""


@dataclass(frozen=True)
class DatasetScan:
    """What a dataset folder holds.

    Attributes:
        root: the dataset folder.
        samples: the images (unique files), sorted by folder and name.
        skipped: counts of what was not read, by reason (``hidden or system files``,
            ``other files``, ``other folders``).
        ignored_folders: subfolders that are not ``<repeats>_<name>`` folders (not read).
    """

    root: Path
    samples: list[Sample]
    skipped: dict[str, int]
    ignored_folders: list[str]

    @property
    def epoch(self) -> list[int]:
        """Sample indices of one epoch: each sample as many times as its repeats."""
        return [i for i, sample in enumerate(self.samples) for _ in range(sample.repeats)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready: images, images per epoch, repeats per subfolder, skipped counts."""
        folders = {s.image.parent.name: s.repeats for s in self.samples if s.image.parent != self.root}
        return {"images": len(self.samples), "images_per_epoch": len(self.epoch), "repeats": folders,
                "skipped": self.skipped, "ignored_folders": self.ignored_folders}


def _hidden(path: Path) -> bool:
    return path.name.startswith(".") or path.name.lower() in HIDDEN_NAMES or path.name == "__MACOSX"


def scan_dataset(folder: str | Path) -> DatasetScan:
    """The images of ``folder`` and of its ``<repeats>_<name>`` subfolders, with their captions.

    Raises:
        DatasetError: the folder does not exist, holds no image, a caption is not UTF-8, or a
            repeats folder says 0 repeats (the message names the folder and what to do).
    """
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"data={str(root)!r} is not a folder")
    skipped = {"hidden or system files": 0, "other files": 0, "other folders": 0}
    samples, ignored = [], []
    sources = [(root, 1)]
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        match = REPEATS_FOLDER.match(sub.name)
        if _hidden(sub):
            skipped["hidden or system files"] += 1
        elif match is None:
            skipped["other folders"] += 1
            ignored.append(sub.name)
        elif int(match.group(1)) < 1:
            raise DatasetError(f"data subfolder {sub.name!r} asks for {match.group(1)} repeats: allowed 1 or more "
                               "(kohya-style <repeats>_<name>); rename it, or move it out of the dataset")
        else:
            sources.append((sub, int(match.group(1))))
    for source, repeats in sources:
        for path in sorted(p for p in source.iterdir() if p.is_file()):
            if _hidden(path):
                skipped["hidden or system files"] += 1
            elif path.suffix.lower() in IMAGE_SUFFIXES:
                samples.append(Sample(path, _caption(path), repeats))
            elif path.suffix.lower() != ".txt":
                skipped["other files"] += 1
    if not samples:
        extra = (f"; subfolders {', '.join(ignored)} are not read (only images directly inside, or in kohya-style "
                 "<repeats>_<name> subfolders)") if ignored else ""
        raise DatasetError(f"data={str(root)!r} holds no image ({', '.join(IMAGE_SUFFIXES)}){extra}")
    return DatasetScan(root, samples, skipped, ignored)


def scan_folder(folder: str | Path) -> list[Sample]:
    """The samples of :func:`scan_dataset`."""
    return scan_dataset(folder).samples


def _caption(image: Path) -> str:
    txt = image.with_suffix(".txt")
    try:
        return txt.read_text(encoding="utf-8").strip() if txt.is_file() else ""
    except UnicodeDecodeError as exc:
        raise DatasetError(f"caption {str(txt)!r} is not UTF-8 text: {exc}") from exc
