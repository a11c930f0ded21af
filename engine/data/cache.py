"""The latent cache: every image encoded once by the VAE and every caption by the text encoder,
kept in memory for the run and on disk for the next one.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..families.base import TextBatch
from ..files.tensors import atomic_save_file
from .buckets import Bucket, make_buckets, nearest_bucket, stack_latents
from .folder import DataWarning, Sample
from .images import image_size, load_image
from .video import load_clip

if TYPE_CHECKING:  # its module imports diffusers; the cache reads its VAE, text encoder and family
    from ..model.bundle import ModelBundle


def assign_buckets(samples: list[Sample], resolution: int, multiple: int,
                   candidates: list[Bucket] | None = None) -> list[Bucket]:
    """Each sample's aspect-ratio bucket (:func:`~.buckets.nearest_bucket` among ``candidates``,
    default :func:`~.buckets.make_buckets` of ``resolution`` and ``multiple`` pixels), from its
    checked size, else its header.

    Raises:
        DatasetError: an image cannot be read.
    """
    candidates = candidates or make_buckets(resolution, multiple)
    return [nearest_bucket(s.size or image_size(s.image), candidates) for s in samples]


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, video: bool) -> torch.Tensor:
    """VAE-encode pixels to normalised latents.

    Args:
        vae: a diffusers autoencoder (2-D, or a video VAE).
        pixels: ``(B, 3, H, W)`` images or ``(B, 3, F, H, W)`` clips, in [-1, 1].
        video: the model takes video latents: the result is ``(B, C, F', H', W')`` (an image
            gives ``F' = 1``); else ``(B, C, h, w)``.

    Uses the posterior mode (deterministic). Normalisation as the family's diffusers pipeline
    does it after encoding: ``latents_mean`` / ``latents_std`` of the config (Wan:
    ``(z - mean) / std``), else the VAE's ``latents_mean`` / ``latents_std`` buffers (LTX-Video:
    ``(z - mean) * scaling_factor / std``, ``pipeline_ltx.py`` ``_normalize_latents``), else
    ``(z - shift_factor) * scaling_factor``.
    """
    cfg = vae.config
    is_3d = hasattr(cfg, "z_dim") or "temperal_downsample" in cfg or "temporal_compression_ratio" in cfg
    x = pixels.unsqueeze(2) if is_3d and pixels.ndim == 4 else pixels
    if x.ndim == 5 and not is_3d:
        raise ValueError(f"the VAE {type(vae).__name__} encodes images, not clips of {x.shape[2]} frames")
    encoded = vae.encode(x)
    z = encoded.latent_dist.mode() if hasattr(encoded, "latent_dist") else encoded.latent
    shape = (1, -1) + (1,) * (z.ndim - 2)
    if getattr(cfg, "latents_mean", None) is not None:
        z = (z - torch.tensor(cfg.latents_mean).view(shape)) / torch.tensor(cfg.latents_std).view(shape)
    elif isinstance(dict(vae.named_buffers(recurse=False)).get("latents_mean"), torch.Tensor):
        scale = getattr(cfg, "scaling_factor", None) or 1.0
        z = (z - vae.latents_mean.view(shape).to(z)) * scale / vae.latents_std.view(shape).to(z)
    else:
        z = (z - (getattr(cfg, "shift_factor", None) or 0.0)) * (getattr(cfg, "scaling_factor", None) or 1.0)
    if video and z.ndim == 4:
        z = z.unsqueeze(2)
    if not video and z.ndim == 5:
        z = z.squeeze(2)
    return z


def _cache_key(samples: list[Sample], resolution: int, vae: torch.nn.Module, extra: str,
               buckets: list[Bucket] | None, windows: list[list[int] | None] | None = None) -> str:
    """A stable function of what the cache depends on: the files (name, size, mtime), captions,
    resolution, each sample's bucket (when bucketing; a clip's carries its frame count), each
    clip's source frame indices (what ``frame_rate``, ``frame_sampling`` and the counts decode),
    the VAE's class and public config, and ``extra``. diffusers' private config entries (``_use_default_values`` is a list built from a
    set, so its order follows ``PYTHONHASHSEED``) are left out."""
    h = hashlib.sha256()
    for s in samples:
        st = s.image.stat()
        h.update(f"{s.image.parent.name}/{s.image.name}|{st.st_size}|{st.st_mtime_ns}|{s.caption}\n".encode())
    if buckets is not None:  # not hashed without buckets: the caches of earlier runs stay valid
        h.update(("buckets:" + ",".join(b.key for b in buckets) + "\n").encode())
    if windows is not None and any(w is not None for w in windows):
        h.update(("windows:" + ";".join("-" if w is None else ",".join(map(str, w)) for w in windows) + "\n").encode())
    public = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    h.update(f"{resolution}|{type(vae).__name__}|{json.dumps(public, sort_keys=True, default=str)}|{extra}".encode())
    return h.hexdigest()[:16]


def prepare_cache(samples: list[Sample], resolution: int, bundle: ModelBundle, cache_dir: str | Path | None,
                  extra: str = "", buckets: list[Bucket] | None = None,
                  windows: list[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Latents and text embeddings of every sample, from the disk cache or freshly encoded by the
    ``bundle``'s VAE (clips as its family's video latents) and text encoder.

    Returns a dict of stacked tensors: ``latents (N, C, ...)``, ``text_seq (N, L, D)``,
    ``text_mask (N, L)`` and ``text_pooled (N, P)`` when the family uses a pooled embedding.
    With ``buckets`` (each sample's, :func:`assign_buckets`) the images are cropped to their
    bucket instead of the ``resolution`` square, and samples of several shapes store their latents
    per bucket (:func:`~.buckets.stack_latents`; read them with :func:`~.buckets.latents_for`).
    ``windows`` gives each clip's source frame indices (None for an image;
    ``engine/data/windows.py``): the clip's frames ``(1, 3, F, H, W)`` are encoded to
    ``(1, C, F', H', W')``.

    Raises:
        DatasetError: an image or clip cannot be read.
    """
    vae, encode_text, video, path = bundle.vae, bundle.encode_text, bundle.family.video_latents, None
    if cache_dir is not None:
        path = Path(cache_dir) / f"cache-{_cache_key(samples, resolution, vae, extra, buckets, windows)}.safetensors"
        if path.is_file():
            try:
                return load_file(str(path))
            except (OSError, SafetensorError, ValueError) as exc:  # truncated, or not a safetensors file
                warnings.warn(f"the latent cache {path.name} is damaged ({exc}): encoding the data again",
                              DataWarning, stacklevel=2)
    sizes = [resolution] * len(samples) if buckets is None else [(b.width, b.height) for b in buckets]
    windows = windows or [None] * len(samples)
    latents = [encode_latents(vae, _pixels(s, size, w), video).float() for s, size, w in zip(samples, sizes, windows)]
    text: TextBatch = encode_text([s.caption for s in samples])
    stacked = {"latents": torch.cat(latents)} if buckets is None else stack_latents(latents, [b.key for b in buckets])
    cache = {**stacked, "text_seq": text.seq.float(), "text_mask": text.mask}
    if text.pooled is not None:
        cache["text_pooled"] = text.pooled.float()
    if path is not None:
        atomic_save_file({k: v.contiguous() for k, v in cache.items()}, path)
    return cache


def _pixels(sample: Sample, size: int | tuple[int, int], window: list[int] | None) -> torch.Tensor:
    """An image ``(1, 3, H, W)``, or a clip's ``window`` frames ``(1, 3, F, H, W)``, in [-1, 1]."""
    if window is None:
        return load_image(sample.image, size)[None]
    return load_clip(sample.image, window, (size, size) if isinstance(size, int) else size)[None]
