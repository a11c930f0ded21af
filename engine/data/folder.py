"""A dataset folder: images with same-name ``.txt`` captions, and the built-in sample photos.

A dataset folder holds images directly, and/or kohya-style ``<repeats>_<name>`` subfolders whose
images count ``repeats`` times per epoch; hidden and system files (``._*`` macOS companions,
``.DS_Store``, ``Thumbs.db``, ``desktop.ini``, any dot-file) are skipped and counted. The
built-in default writes real photographs from scikit-image.

Names are matched as the file systems users come from match them (Windows' NTFS and macOS' APFS
ignore letter case, APFS also the Unicode normal form): an image's caption is the ``.txt`` file
whose stem equals the image's after NFC and case folding (``IMG_01.JPG`` finds ``img_01.txt`` or
``IMG_01.TXT``); two such files (``a.txt`` and ``A.txt``, one file on those systems) are refused.
Captions are read by ``engine/files/text.py`` (UTF-8 with or without a byte-order mark, UTF-16
with one; invisible characters removed; NFC).

Links: file links are followed. Each real folder is read once: a folder link that points at the
dataset folder or a folder above it (which would read the data again, or forever), or at a
folder already read, is not followed; broken links and link loops are not either. Each is
counted under ``link_not_followed`` (:data:`LOSSY_KINDS`) and named with why.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import re
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..families.lazy import lazy_imports
from ..files.atomic import atomic_write_bytes, atomic_write_text
from ..files.text import TextFileError, read_text

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")
"""Video containers decoded with PyAV."""
ANIMATED_SUFFIXES = (".gif", ".webp")
"""Files that are clips when animated (more than one frame), else images (Pillow)."""
CLIP_SUFFIXES = VIDEO_SUFFIXES + (".gif",)
"""Clips (``engine/data/video.py``); an animated ``.webp`` is a clip too, a still ``.gif`` an image."""
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
    many times it counts per epoch (a kohya-style ``<repeats>_<name>`` subfolder's repeats), and
    its size once checked."""

    image: Path
    caption: str
    repeats: int = 1
    size: tuple[int, int] | None = None
    """``(width, height)`` in pixels as a viewer shows the image, once checked (``engine/data/checks.py``)."""
    clip: bool = False
    """A clip (a video file, an animated GIF / WebP: ``engine/data/video.py``), not an image."""
    frames: int = 1
    """Frames the file holds, once checked (1 for an image)."""
    fps: Fraction | None = None
    """A clip's frames per second (exact), once checked."""


def write_sample_dataset(folder: str | Path) -> Path:
    """Write the built-in sample photographs with captions into ``folder`` (idempotent, atomic)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, caption in SAMPLE_PHOTOS.items():
        path = folder / f"{name}.png"
        if not path.exists():
            atomic_write_text(folder / f"{name}.txt", caption + "\n")
            atomic_write_bytes(path, _sample_png(name))
    return folder


@functools.cache
def _sample_png(name: str) -> bytes:
    """The PNG file of sample photograph ``name`` (encoded once per process: about 0.08 s each, and
    every run into a new output folder writes all six; 3.3 MB for the six)."""
    with lazy_imports():
        import skimage.data

    buffer = io.BytesIO()
    Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


HIDDEN_NAMES = ("thumbs.db", "ehthumbs.db", "desktop.ini", "icon\r")
"""System files that are never data (compared case-insensitively), besides every dot-file."""
REPEATS_FOLDER = re.compile(r"^(\d+)_(.+)$")
"""kohya's sd-scripts layout: ``<repeats>_<name>`` subfolders."""
LOSSY_KINDS = ("caption_truncated", "image_upscaled", "image_skipped", "link_not_followed", "clip_truncated",
               "clip_skipped")
"""What a run may lose of its data, each counted in ``report.json`` ``dataset.lossy`` and named in
one warning: a caption longer than the text encoder reads, an image upscaled or skipped
(``engine/data/checks.py`` states the factors), a link not followed (see the module docstring), a
clip that ends before the frames its file states (it trains on the frames that decode:
``engine/data/video.py``), a clip skipped (shorter than the smallest frame count, or in an image
family's data)."""
NAMED = 5
"""Entries named per kind in the warning and in ``report.json`` ``dataset.lossy_files``."""


@dataclass(frozen=True)
class DatasetScan:
    """What a dataset folder holds.

    Attributes:
        root: the dataset folder.
        samples: the images (unique files), sorted by folder and name.
        skipped: counts of what was not read, by reason (``hidden or system files``,
            ``other files``, ``other folders``).
        ignored_folders: subfolders that are not ``<repeats>_<name>`` folders (not read).
        lossy: per kind of :data:`LOSSY_KINDS`, the entries it applies to (names relative to
            ``root``, with why: ``5_again (points at the dataset folder or above)``).
    """

    root: Path
    samples: list[Sample]
    skipped: dict[str, int]
    ignored_folders: list[str]
    lossy: dict[str, list[str]] = field(default_factory=lambda: {kind: [] for kind in LOSSY_KINDS})

    @property
    def epoch(self) -> list[int]:
        """Sample indices of one epoch: each sample as many times as its repeats."""
        return [i for i, sample in enumerate(self.samples) for _ in range(sample.repeats)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready: images, clips, images per epoch, repeats per subfolder, skipped counts, ``lossy``
        (a count per kind of :data:`LOSSY_KINDS`, zeros included) and ``lossy_files`` (the first
        :data:`NAMED` entries of each kind that happened)."""
        folders = {s.image.parent.name: s.repeats for s in self.samples if s.image.parent != self.root}
        return {"images": len(self.samples), "clips": sum(s.clip for s in self.samples), "images_per_epoch": len(self.epoch), "repeats": folders,
                "skipped": self.skipped, "ignored_folders": self.ignored_folders,
                "lossy": {kind: len(self.lossy.get(kind, [])) for kind in LOSSY_KINDS},
                "lossy_files": {kind: self.lossy[kind][:NAMED] for kind in LOSSY_KINDS if self.lossy.get(kind)}}


def _hidden(path: Path) -> bool:
    return path.name.startswith(".") or path.name.lower() in HIDDEN_NAMES or path.name == "__MACOSX"


def name_key(name: str) -> str:
    """A file name as NTFS and APFS compare it: NFC, case-folded."""
    return unicodedata.normalize("NFC", name).casefold()


def _dead_link(path: Path) -> str | None:
    """Why ``path`` is a link that leads nowhere (``a broken link``, ``a link loop``), else None."""
    if not path.is_symlink() or path.exists():
        return None
    try:
        os.stat(path)
    except OSError as exc:
        return "a link loop" if exc.errno == errno.ELOOP else "a broken link"
    return None


def _sources(root: Path, skipped: dict[str, int], ignored: list[str],
             links: list[str]) -> list[tuple[Path, int]]:
    """The folders read, with their repeats: ``root`` and its ``<repeats>_<name>`` subfolders,
    each real folder once (real subfolders before links to them), sorted by name."""
    real_root = root.resolve()
    above, read = {real_root, *real_root.parents}, {real_root}
    chosen = []
    subfolders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: (p.is_symlink(), p.name))
    for sub in subfolders:
        match = REPEATS_FOLDER.match(sub.name)
        if _hidden(sub):
            skipped["hidden or system files"] += 1
        elif match is None:
            skipped["other folders"] += 1
            ignored.append(sub.name)
        elif int(match.group(1)) < 1:
            raise DatasetError(f"data subfolder {sub.name!r} asks for {match.group(1)} repeats: allowed 1 or more "
                               "(kohya-style <repeats>_<name>); rename it, or move it out of the dataset")
        elif sub.resolve() in above:
            links.append(f"{sub.name} (points at the dataset folder or above)")
        elif sub.resolve() in read:
            links.append(f"{sub.name} (a folder already read)")
        else:
            read.add(sub.resolve())
            chosen.append((sub, int(match.group(1))))
    return [(root, 1)] + sorted(chosen, key=lambda c: c[0].name)


def is_clip_file(path: Path) -> bool:
    """Whether ``path`` is a clip: a video container, or a GIF / WebP with more than one frame
    (read from its header)."""
    suffix = path.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        return True
    if suffix not in ANIMATED_SUFFIXES:
        return False
    try:
        with Image.open(path) as image:
            return getattr(image, "n_frames", 1) > 1
    except (UnidentifiedImageError, OSError, ValueError):
        return suffix == ".gif"  # a damaged GIF is named by the clip check


def scan_dataset(folder: str | Path) -> DatasetScan:
    """The images of ``folder`` and of its ``<repeats>_<name>`` subfolders, with their captions
    (matched and read as the module docstring says).

    Raises:
        DatasetError: the folder does not exist, holds no image, a caption cannot be decoded
            (named with the byte offset), two captions of one image differ only in letter case, or
            a repeats folder says 0 repeats (the message names the folder and what to do).
    """
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"data={str(root)!r} is not a folder")
    skipped = {"hidden or system files": 0, "other files": 0, "other folders": 0}
    samples, ignored, links = [], [], []
    for source, repeats in _sources(root, skipped, ignored, links):
        entries = sorted(source.iterdir())
        captions: dict[str, list[Path]] = {}
        for path in entries:
            if path.suffix.lower() == ".txt" and path.is_file() and not _hidden(path):
                captions.setdefault(name_key(path.stem), []).append(path)
        for path in entries:
            dead = None if _hidden(path) else _dead_link(path)
            if dead is not None:
                links.append(f"{path.relative_to(root).as_posix()} ({dead})")
            elif not path.is_file():
                continue
            elif _hidden(path):
                skipped["hidden or system files"] += 1
            elif path.suffix.lower() in IMAGE_SUFFIXES + CLIP_SUFFIXES:
                samples.append(Sample(path, _caption(path, captions.get(name_key(path.stem), [])), repeats,
                                      clip=is_clip_file(path)))
            elif path.suffix.lower() != ".txt":
                skipped["other files"] += 1
    if not samples:
        extra = (f"; subfolders {', '.join(ignored)} are not read (only images directly inside, or in kohya-style "
                 "<repeats>_<name> subfolders)") if ignored else ""
        raise DatasetError(f"data={str(root)!r} holds no image ({', '.join(IMAGE_SUFFIXES)}) or clip "
                           f"({', '.join(CLIP_SUFFIXES)}){extra}")
    lossy = {kind: [] for kind in LOSSY_KINDS}
    lossy["link_not_followed"] = links
    return DatasetScan(root, samples, skipped, ignored, lossy)


def scan_folder(folder: str | Path) -> list[Sample]:
    """The samples of :func:`scan_dataset`."""
    return scan_dataset(folder).samples


def _caption(image: Path, candidates: list[Path]) -> str:
    """The caption of ``image``: its one same-stem ``.txt`` file (any letter case), stripped, or ""."""
    if len(candidates) > 1:
        names = " and ".join(repr(str(c)) for c in candidates)
        raise DatasetError(f"captions {names} of image {str(image)!r} differ only in letter case (one file on "
                           "Windows and macOS): keep one")
    try:
        return read_text(candidates[0], "caption").strip() if candidates else ""
    except TextFileError as exc:
        raise DatasetError(str(exc)) from exc
