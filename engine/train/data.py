"""Training data: a folder of images with same-name ``.txt`` captions, encoded once to latents.

A dataset folder holds images directly, and/or kohya-style ``<repeats>_<name>`` subfolders whose
images count ``repeats`` times per epoch; hidden and system files (``._*`` macOS companions,
``.DS_Store``, ``Thumbs.db``, ``desktop.ini``, any dot-file) are skipped and counted. Images
appear as a viewer shows them (:func:`to_rgb`), are centre-cropped and resized to a square
resolution, or with aspect-ratio buckets to their bucket (:mod:`.buckets`), with Pillow
(``ImageOps.fit``), scaled to [-1, 1] and encoded by the VAE once; latents and text embeddings are
cached (in memory for the run, and on disk, keyed by the files' names, sizes and modification
times, the captions, the resolution, the buckets and the VAE's public config) so a resumed run
does not re-encode. The built-in default writes real photographs from scikit-image.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..families.base import TextBatch
from .atomic import atomic_save_file, atomic_write_bytes, atomic_write_text
from .buckets import Bucket, make_buckets, nearest_bucket, stack_latents

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


BACKGROUND = (255, 255, 255)
"""Transparent pixels are composited onto white, as kohya's sd-scripts and SimpleTuner do."""
_INTEGER_RANGE = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535}


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as an image viewer shows ``image``.

    Transparency (an alpha channel, a palette or ``tRNS`` transparent colour) is composited onto
    :data:`BACKGROUND`; 16-bit grey is scaled by its format's range (65535), 32-bit integer grey
    by 2**31 - 1 (a PNG's by 65535: PNG stores at most 16 bits), float grey by 1.0, never by the
    image's own maximum; every other mode converts through Pillow (CMYK, YCbCr, bilevel, ...).
    """
    if image.mode in _INTEGER_RANGE or image.mode in ("I", "F"):
        top = _INTEGER_RANGE.get(image.mode) or (1.0 if image.mode == "F" else
                                                 65535 if image.format == "PNG" else 2**31 - 1)
        array = np.asarray(image, dtype=np.float64) / top * 255.0
        image = Image.fromarray(np.clip(np.round(array), 0, 255).astype(np.uint8), "L")
    if image.has_transparency_data:
        background = Image.new("RGBA", image.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def load_image(path: Path, size: int | tuple[int, int]) -> torch.Tensor:
    """Read (as a viewer shows it), resize to cover and centre-crop an image: ``(3, H, W)`` float in [-1, 1].

    Args:
        path: the image file.
        size: a square side ``R`` in pixels, or a bucket's ``(width, height)`` in pixels.

    Raises:
        DatasetError: the file cannot be read as an image (the message names the file).
    """
    width, height = (size, size) if isinstance(size, int) else size
    try:
        with Image.open(path) as image:
            image = to_rgb(ImageOps.exif_transpose(image))
            image = ImageOps.fit(image, (width, height), method=Image.Resampling.LANCZOS)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"image {str(path)!r} could not be read: {exc}") from exc
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


_TRANSPOSING = (5, 6, 7, 8)
"""EXIF orientations that swap width and height (transpose, rotate 90/270, transverse)."""


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` in pixels as a viewer shows the image (EXIF orientation applied); reads
    the header only.

    Raises:
        DatasetError: the file cannot be read as an image (the message names the file).
    """
    try:
        with Image.open(path) as image:
            width, height = image.size
            if image.getexif().get(0x0112) in _TRANSPOSING:  # 0x0112: the EXIF Orientation tag
                width, height = height, width
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"image {str(path)!r} could not be read: {exc}") from exc
    return width, height


def assign_buckets(samples: list[Sample], resolution: int, multiple: int) -> list[Bucket]:
    """Each sample's aspect-ratio bucket (:func:`~.buckets.nearest_bucket` among
    :func:`~.buckets.make_buckets` of ``resolution`` and ``multiple`` pixels).

    Raises:
        DatasetError: an image cannot be read.
    """
    candidates = make_buckets(resolution, multiple)
    return [nearest_bucket(image_size(s.image), candidates) for s in samples]


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, video: bool) -> torch.Tensor:
    """VAE-encode ``(B, 3, H, W)`` pixels to normalised latents ``(B, C, h, w)`` or ``(B, C, 1, h, w)``.

    Uses the posterior mode (deterministic). Normalisation follows the VAE config: ``latents_mean``
    / ``latents_std`` when present (Wan-style), else ``(z - shift_factor) * scaling_factor``.
    """
    cfg = vae.config
    is_3d = hasattr(cfg, "z_dim") or "temperal_downsample" in cfg
    x = pixels.unsqueeze(2) if is_3d else pixels
    encoded = vae.encode(x)
    z = encoded.latent_dist.mode() if hasattr(encoded, "latent_dist") else encoded.latent
    if getattr(cfg, "latents_mean", None) is not None:
        shape = (1, -1) + (1,) * (z.ndim - 2)
        z = (z - torch.tensor(cfg.latents_mean).view(shape)) / torch.tensor(cfg.latents_std).view(shape)
    else:
        z = (z - (getattr(cfg, "shift_factor", None) or 0.0)) * (getattr(cfg, "scaling_factor", None) or 1.0)
    if video and z.ndim == 4:
        z = z.unsqueeze(2)
    if not video and z.ndim == 5:
        z = z.squeeze(2)
    return z


def _cache_key(samples: list[Sample], resolution: int, vae: torch.nn.Module, extra: str,
               buckets: list[Bucket] | None) -> str:
    """A stable function of what the cache depends on: the files (name, size, mtime), captions,
    resolution, each sample's bucket (when bucketing), the VAE's class and public config, and
    ``extra``. diffusers' private config entries (``_use_default_values`` is a list built from a
    set, so its order follows ``PYTHONHASHSEED``) are left out."""
    h = hashlib.sha256()
    for s in samples:
        st = s.image.stat()
        h.update(f"{s.image.parent.name}/{s.image.name}|{st.st_size}|{st.st_mtime_ns}|{s.caption}\n".encode())
    if buckets is not None:  # not hashed without buckets: the caches of earlier runs stay valid
        h.update(("buckets:" + ",".join(b.key for b in buckets) + "\n").encode())
    public = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    h.update(f"{resolution}|{type(vae).__name__}|{json.dumps(public, sort_keys=True, default=str)}|{extra}".encode())
    return h.hexdigest()[:16]


def prepare_cache(samples: list[Sample], resolution: int, vae: torch.nn.Module, encode_text,
                  video: bool, cache_dir: str | Path | None, extra: str = "",
                  buckets: list[Bucket] | None = None) -> dict[str, torch.Tensor]:
    """Latents and text embeddings of every sample, from the disk cache or freshly encoded.

    Returns a dict of stacked tensors: ``latents (N, C, ...)``, ``text_seq (N, L, D)``,
    ``text_mask (N, L)`` and ``text_pooled (N, P)`` when the family uses a pooled embedding.
    With ``buckets`` (each sample's, :func:`assign_buckets`) the images are cropped to their
    bucket instead of the ``resolution`` square, and samples of several shapes store their latents
    per bucket (:func:`~.buckets.stack_latents`; read them with :func:`~.buckets.latents_for`).

    Raises:
        DatasetError: an image cannot be read.
    """
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"cache-{_cache_key(samples, resolution, vae, extra, buckets)}.safetensors"
        if path.is_file():
            try:
                return load_file(str(path))
            except (OSError, SafetensorError, ValueError) as exc:  # truncated, or not a safetensors file
                warnings.warn(f"the latent cache {path.name} is damaged ({exc}): encoding the data again",
                              DataWarning, stacklevel=2)
    sizes = [resolution] * len(samples) if buckets is None else [(b.width, b.height) for b in buckets]
    latents = [encode_latents(vae, load_image(s.image, size)[None], video).float() for s, size in zip(samples, sizes)]
    text: TextBatch = encode_text([s.caption for s in samples])
    stacked = {"latents": torch.cat(latents)} if buckets is None else stack_latents(latents, [b.key for b in buckets])
    cache = {**stacked, "text_seq": text.seq.float(), "text_mask": text.mask}
    if text.pooled is not None:
        cache["text_pooled"] = text.pooled.float()
    if path is not None:
        atomic_save_file({k: v.contiguous() for k, v in cache.items()}, path)
    return cache


class EpochSampler:
    """Deterministic shuffled batches: epoch ``e`` uses permutation ``randperm(N, seed + e)``.

    The position ``(epoch, index)`` is all the state there is, so a resumed run continues with
    exactly the batches an uninterrupted run would have drawn.
    """

    def __init__(self, size: int, batch_size: int, seed: int, epoch: int = 0, index: int = 0):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.index = epoch, index

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> list[int]:
        """Indices of the next batch (crossing into the next epoch when needed)."""
        out = []
        while len(out) < self.batch_size:
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
            out.append(int(self._order()[self.index]))
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        """``{"epoch": e, "index": i}``."""
        return {"epoch": self.epoch, "index": self.index}
