"""Training data: a folder of images with same-name ``.txt`` captions, encoded once to latents.

Images are centre-cropped and resized to a square resolution with Pillow
(``ImageOps.fit``), scaled to [-1, 1] and encoded by the VAE once; latents and text embeddings are
cached (in memory for the run, and on disk under the output folder, keyed by the files' names,
sizes and modification times, the resolution and the VAE config) so a resumed run does not
re-encode. The built-in default writes real photographs shipped in scikit-image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from safetensors.torch import load_file

from ..families.base import TextBatch
from .atomic import atomic_save_file

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


@dataclass(frozen=True)
class Sample:
    """One training example: an image file and its caption (empty when no ``.txt`` exists)."""

    image: Path
    caption: str


def write_sample_dataset(folder: str | Path) -> Path:
    """Write the built-in sample photographs with captions into ``folder`` (idempotent)."""
    import skimage.data

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, caption in SAMPLE_PHOTOS.items():
        path = folder / f"{name}.png"
        if not path.exists():
            pixels = getattr(skimage.data, name)()
            image = Image.fromarray(pixels).convert("RGB")
            image.save(path)
            (folder / f"{name}.txt").write_text(caption + "\n", encoding="utf-8")
    return folder


def scan_folder(folder: str | Path) -> list[Sample]:
    """The images of ``folder`` (sorted by name) with their captions.

    Raises:
        DatasetError: the folder does not exist or holds no image.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"data={str(folder)!r} is not a folder")
    samples = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
            txt = path.with_suffix(".txt")
            try:
                caption = txt.read_text(encoding="utf-8").strip() if txt.is_file() else ""
            except UnicodeDecodeError as exc:
                raise DatasetError(f"caption {str(txt)!r} is not UTF-8 text: {exc}") from exc
            samples.append(Sample(path, caption))
    if not samples:
        raise DatasetError(f"data={str(folder)!r} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return samples


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """Read, centre-crop and resize an image: ``(3, R, R)`` float in [-1, 1].

    Raises:
        DatasetError: the file cannot be read as an image (the message names the file).
    """
    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image)
            if image.mode.startswith("I"):  # 16/32-bit grey: scale to 8 bits before RGB (else clipped)
                array = np.asarray(image, dtype=np.float64)
                image = Image.fromarray((array / max(array.max(), 1.0) * 255.0).astype(np.uint8))
            image = image.convert("RGB")
            image = ImageOps.fit(image, (resolution, resolution), method=Image.Resampling.LANCZOS)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"image {str(path)!r} could not be read: {exc}") from exc
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


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


def _cache_key(samples: list[Sample], resolution: int, vae: torch.nn.Module, extra: str) -> str:
    h = hashlib.sha256()
    for s in samples:
        st = s.image.stat()
        h.update(f"{s.image.name}|{st.st_size}|{st.st_mtime_ns}|{s.caption}\n".encode())
    h.update(f"{resolution}|{json.dumps(dict(vae.config), sort_keys=True, default=str)}|{extra}".encode())
    return h.hexdigest()[:16]


def prepare_cache(samples: list[Sample], resolution: int, vae: torch.nn.Module, encode_text,
                  video: bool, cache_dir: str | Path | None, extra: str = "") -> dict[str, torch.Tensor]:
    """Latents and text embeddings of every sample, from the disk cache or freshly encoded.

    Returns a dict of stacked tensors: ``latents (N, C, ...)``, ``text_seq (N, L, D)``,
    ``text_mask (N, L)`` and ``text_pooled (N, P)`` when the family uses a pooled embedding.

    Raises:
        DatasetError: an image cannot be read.
    """
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"cache-{_cache_key(samples, resolution, vae, extra)}.safetensors"
        if path.is_file():
            return load_file(str(path))
    latents = torch.cat([encode_latents(vae, load_image(s.image, resolution)[None], video) for s in samples])
    text: TextBatch = encode_text([s.caption for s in samples])
    cache = {"latents": latents.float(), "text_seq": text.seq.float(), "text_mask": text.mask}
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
