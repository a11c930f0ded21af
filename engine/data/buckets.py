"""Aspect-ratio buckets: images of several shapes trained at about one pixel area, never mixed in a batch.

The rule is the field's (kohya-ss sd-scripts ``BucketManager`` / ``make_bucket_resolutions``,
SimpleTuner's ``pixel_area`` resolution type): the candidate buckets keep the area of a
``resolution x resolution`` square with sides in multiples of what the model needs; each image
goes to the bucket of the nearest aspect ratio, is resized to cover it and centre-cropped to it;
every batch comes from one bucket; a bucket's last batch of an epoch may be smaller (kohya keeps
it: ``ceil(len(bucket) / batch_size)`` batches per bucket), and the batch order is shuffled under
the seed per epoch.

The cache format (:func:`stack_latents`): one shape keeps the plain ``latents (N, C, ...)``
tensor; several store ``latents.<WxH> (n_b, C, ...)`` per bucket plus ``bucket_index (N,)`` (the
bucket of each row: the ``i``-th ``latents.<WxH>`` key in (width, height) order) and
``bucket_row (N,)`` (its row in that tensor). Every consumer reads latents through
:func:`latents_for`, :func:`shape_classes` and :func:`sample_latent_shape`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..config import ConfigError
from ..families import FamilyAdapter
from ..families.limits import Limits, token_patch  # noqa: F401 (token_patch re-exported)

MAX_ASPECT = 4.0
"""Widest bucket, width:height or height:width (kohya's defaults at 512 px: sides 256 to 1024, 1:4 to 4:1)."""
PREFIX = "latents."
"""Cache keys of per-bucket latents: ``latents.<WxH>``."""


@dataclass(frozen=True)
class Bucket:
    """A training size: pixels, and pixel frames for clips.

    Attributes:
        width, height: pixels, multiples of the model's pixel multiple (:func:`pixel_multiple`).
        frames: pixel frames (1: an image; a clip's frame bucket, ``engine/data/windows.py``).
    """

    width: int
    height: int
    frames: int = 1

    @property
    def key(self) -> str:
        """``"<width>x<height>"``, e.g. ``"768x1344"``; a clip's ``"<width>x<height>x<frames>"`` (``"480x832x33"``)."""
        return f"{self.width}x{self.height}" if self.frames == 1 else f"{self.width}x{self.height}x{self.frames}"

    def latent_hw(self, downscale: int) -> tuple[int, int]:
        """Latent ``(h, w)`` of this bucket under a VAE of ``downscale`` pixels per latent cell."""
        return self.height // downscale, self.width // downscale


def make_buckets(resolution: int, multiple: int, max_aspect: float = MAX_ASPECT) -> list[Bucket]:
    """The candidate buckets of a pixel-area target, sorted by (width, height).

    For each width ``w`` in multiples of ``multiple`` up to the square's side, the tallest height
    in multiples of ``multiple`` whose area stays within ``resolution ** 2`` (kohya's rule), and
    its transpose; buckets more elongated than ``max_aspect`` are left out. The square of side
    ``resolution`` rounded down to the multiple is always one of them (kohya adds it too).

    Args:
        resolution: side in pixels of the square whose area every bucket approximates (from below).
        multiple: pixels each side must be a multiple of.
        max_aspect: the largest ``long side / short side``.

    Raises:
        ConfigError: ``resolution`` is smaller than ``multiple``.
    """
    if resolution < multiple:
        raise ConfigError(f"resolution={resolution} is invalid with buckets: allowed at least {multiple} (pixels; "
                          "the model's bucket sides are multiples of it)")
    area, side = resolution * resolution, resolution // multiple * multiple
    found = {Bucket(side, side)}
    for width in range(multiple, side + 1, multiple):
        height = area // width // multiple * multiple
        if height / width <= max_aspect:
            found.update({Bucket(width, height), Bucket(height, width)})
    return sorted(found, key=lambda b: (b.width, b.height))


def nearest_bucket(size: tuple[int, int], buckets: list[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest ``size = (width, height)`` in pixels.

    Aspect ratios are compared as ``|log(w / h) - log(W / H)|``, so 2:1 and 1:2 are equally far
    from 1:1; ties go to the larger area, then the wider bucket (deterministic).
    """
    log_aspect = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b.width / b.height) - log_aspect), -b.width * b.height,
                                       -b.width))


def latent_multiple(family: FamilyAdapter, config: Mapping[str, Any]) -> int:
    """What each latent side must be a multiple of: the family's declared ``latent_multiple``, else
    :func:`token_patch`."""
    return family.latent_multiple or token_patch(family, config)


def vae_downscale(vae: torch.nn.Module) -> int:
    """Pixels per latent cell of a diffusers VAE.

    As diffusers' pipelines read it: the VAE's ``spatial_compression_ratio`` (Wan, Qwen-Image,
    HunyuanVideo, LTX-Video, Cosmos, DC-AE set it), else ``2 ** len(temperal_downsample)`` (Wan-style
    configs), else ``2 ** (len(block_out_channels) - 1)`` (``AutoencoderKL``: 8 for 4 blocks).

    Raises:
        ValueError: the VAE says none of these (its class named).
    """
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if isinstance(ratio, int) and ratio >= 1:
        return ratio
    cfg = vae.config
    if cfg.get("temperal_downsample"):
        return 2 ** len(cfg["temperal_downsample"])
    if cfg.get("block_out_channels"):
        return 2 ** (len(cfg["block_out_channels"]) - 1)
    raise ValueError(f"buckets: the VAE {type(vae).__name__} does not say its spatial downscale "
                     "(spatial_compression_ratio, temperal_downsample or block_out_channels)")


def pixel_multiple(family: FamilyAdapter, config: Mapping[str, Any], vae: torch.nn.Module) -> int:
    """Pixels each bucket side must be a multiple of: :func:`vae_downscale` x :func:`latent_multiple`
    (Flux: 8 x 2 = 16; Sana with its 32x DC-AE: 32 x 1)."""
    return vae_downscale(vae) * latent_multiple(family, config)


def split_buckets(candidates: list[Bucket], limits: Limits, downscale: int,
                  patch: int) -> tuple[list[Bucket], list[Bucket]]:
    """``(kept, left_out)``: the candidate buckets whose token grid (latent ``h // patch`` by
    ``w // patch``) is within the model's ``limits`` (``engine/families/limits.py``), and the rest.

    Args:
        downscale: pixels per latent cell (:func:`vae_downscale`).
        patch: latent cells per token side (:func:`token_patch`).
    """
    kept, left_out = [], []
    for bucket in candidates:
        h, w = bucket.latent_hw(downscale)
        (kept if limits.fits(h // patch, w // patch) else left_out).append(bucket)
    return kept, left_out


def bucket_summary(chosen: list[Bucket], epoch: list[int], downscale: int, patch: int) -> list[dict[str, Any]]:
    """``report.json`` ``dataset.buckets``: per bucket, largest first (tokens, then height, then width:
    the order of :func:`shape_classes`).

    Args:
        chosen: the bucket of each sample.
        epoch: the sample of each position of an epoch (repeats included).
        downscale: pixels per latent cell (:func:`vae_downscale`).
        patch: latent cells per token side (:func:`token_patch`).

    Returns:
        ``[{"bucket": "WxH", "width", "height", "images", "images_per_epoch", "image_tokens"}]``
        (and ``"frames"`` for a clip's bucket ``WxHxF``); ``image_tokens`` is the transformer's
        sequence length per latent frame, latent ``h * w / patch ** 2``.
    """
    images, per_epoch = Counter(chosen), Counter(chosen[i] for i in epoch)
    rows = []
    for bucket in images:
        h, w = bucket.latent_hw(downscale)
        row = {"bucket": bucket.key, "width": bucket.width, "height": bucket.height, "images": images[bucket],
               "images_per_epoch": per_epoch[bucket], "image_tokens": h * w // (patch * patch)}
        rows.append(row if bucket.frames == 1 else {**row, "frames": bucket.frames})
    return sorted(rows, key=lambda r: (-r["image_tokens"] * r.get("frames", 1), -r["height"], -r["width"]))


def describe_buckets(summary: list[dict[str, Any]]) -> str:
    """One log line: ``buckets: 80x48 (3 images, 15 tokens), 64x64 (2 images, 16 tokens)``."""
    return "buckets: " + ", ".join(f"{r['bucket']} ({r['images']} {'clips' if r.get('frames') else 'images'}, "
                                   f"{r['image_tokens']} tokens{' per latent frame' if r.get('frames') else ''})"
                                   for r in summary)


def stack_latents(latents: list[torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """The cache's latent entries of N samples.

    Args:
        latents: one ``(1, C, ...)`` tensor per sample, in sample order.
        keys: each sample's bucket key (``"WxH"``).

    Returns:
        ``{"latents": (N, C, ...)}`` when every sample has one shape; else ``latents.<WxH>``
        ``(n_b, C, ...)`` per bucket (rows in sample order), ``bucket_index (N,)`` and
        ``bucket_row (N,)`` int64 (see the module docstring).
    """
    if len(set(keys)) == 1:
        return {"latents": torch.cat(latents)}
    names = sorted(set(keys), key=_size)
    cache = {f"{PREFIX}{name}": torch.cat([x for x, k in zip(latents, keys) if k == name]) for name in names}
    seen: Counter[str] = Counter()
    rows = []
    for key in keys:
        rows.append(seen[key])
        seen[key] += 1
    cache["bucket_index"] = torch.tensor([names.index(k) for k in keys], dtype=torch.long)
    cache["bucket_row"] = torch.tensor(rows, dtype=torch.long)
    return cache


def _size(name: str) -> tuple[int, ...]:
    """``(width, height)`` or ``(width, height, frames)`` of a bucket key (frames 1 sorts first)."""
    parts = [int(p) for p in name.split("x")]
    return (*parts, 1) if len(parts) == 2 else tuple(parts)


def _bucket_keys(cache: Mapping[str, torch.Tensor]) -> list[str]:
    """The ``latents.<WxH>`` keys in (width, height) order: ``bucket_index`` counts in this order."""
    return sorted((k for k in cache if k.startswith(PREFIX)), key=lambda k: _size(k[len(PREFIX):]))


def latents_for(cache: Mapping[str, torch.Tensor], rows: list[int]) -> torch.Tensor:
    """The latents of cache ``rows``: ``(len(rows), C, ...)``.

    Raises:
        ValueError: the rows belong to different buckets (a batch never mixes them).
    """
    if "latents" in cache:
        return cache["latents"][rows]
    index = cache["bucket_index"][rows]
    if bool((index != index[0]).any()):
        keys = _bucket_keys(cache)
        spans = sorted({keys[i][len(PREFIX):] for i in index.tolist()})
        raise ValueError(f"cache rows {rows} span buckets {', '.join(spans)}: a batch takes rows of one bucket")
    return cache[_bucket_keys(cache)[int(index[0])]][cache["bucket_row"][rows]]


def shape_classes(cache: Mapping[str, torch.Tensor]) -> list[tuple[tuple[int, ...], list[int]]]:
    """The latent shapes of the cache and their rows: ``[((C, h, w) or (C, 1, h, w), rows)]``,
    largest shape first (by elements, then the taller), rows ascending."""
    if "latents" in cache:
        latents = cache["latents"]
        return [(tuple(latents.shape[1:]), list(range(latents.shape[0])))]
    index = cache["bucket_index"].tolist()
    classes = [(tuple(cache[key].shape[1:]), [r for r, i in enumerate(index) if i == b])
               for b, key in enumerate(_bucket_keys(cache))]
    return sorted(classes, key=lambda c: (-math.prod(c[0]), [-d for d in c[0]]))


def sample_latent_shape(cache: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
    """One sample's latent shape for previews: the most common (ties: the largest)."""
    return max(shape_classes(cache), key=lambda c: len(c[1]))[0]
