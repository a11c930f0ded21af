"""A run's training data: the latent cache (encoded once from an image folder, or prepared by a
caller) and the sampler that draws its batches."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError, DataConfig, ModelConfig
from ..families import TextBatch
from ..families.limits import describe_bound, largest_square, model_limits
from ..model.bundle import ModelBundle, ModelLoadError
from ..model.text_encoders import TextEncoderWarning, caption_overflow, describe_text_encoder, stand_in_warning
from .buckets import (
    Bucket,
    bucket_summary,
    describe_buckets,
    make_buckets,
    pixel_multiple,
    shape_classes,
    split_buckets,
    token_patch,
    vae_downscale,
)
from .cache import assign_buckets, encode_latents, prepare_cache
from .checks import check_dataset, relative_name, screen_sizes, warn_lossy
from .comfy_data import ComfyDataError, PreparedData
from .folder import DatasetError, DatasetScan, DataWarning, write_sample_dataset
from .samplers import BucketSampler, EpochSampler, bucket_groups
from .video import write_sample_clip
from .windows import RandomWindows, choose_frames, first_window, frames_summary


@dataclass
class RunData:
    """What :func:`prepare_run_data` gives a run.

    Attributes:
        cache: latents and text states by name (``latents`` ``(N, C, h, w)`` or per-bucket
            entries, ``text_seq`` ``(N, L, D)``, ``text_mask`` ``(N, L)``, ``text_pooled`` ``(N, P)``).
        epoch: the cache row of each position of an epoch (a sample as often as its repeats).
        summary: the dataset summary for ``report.json`` (with ``buckets`` when bucketed).
        text_encoder: what encoded the captions (``kind``; a ``warning`` for the stand-in).
        dataset: the scanned image folder (None for prepared data).
    """

    cache: dict[str, torch.Tensor]
    epoch: list[int]
    summary: dict[str, Any]
    text_encoder: dict[str, Any]
    dataset: DatasetScan | None = None
    random_windows: RandomWindows | None = None
    """``frame_sampling=random``: draws and encodes the clips' windows per batch (``engine/data/windows.py``)."""
    empty_text: TextBatch | None = None
    """``caption_dropout``: the empty caption's conditioning, ``(1, L, D)`` (:func:`empty_caption`)."""


def prepared_run_data(prepared: PreparedData, bundle: ModelBundle, log: Callable[[str], None]) -> RunData:
    """A run's training data from the latents and text a caller prepared (ComfyUI's encoders).

    Raises:
        ComfyDataError: prepared data of another family.
    """
    if prepared.family != bundle.family.name:
        raise ComfyDataError(f"the prepared data is for family {prepared.family!r} but the model is "
                             f"{bundle.family.name!r}")
    log(f"data: {prepared.describe()}")
    return RunData(prepared.cache, list(range(prepared.count)), prepared.summary, {"kind": "comfyui conditioning"})


def prepare_run_data(data: DataConfig, model: ModelConfig, seed: int, bundle: ModelBundle, cache_dir: Path,
                     output: Path, log: Callable[[str], None], announce: bool = True) -> RunData:
    """A run's training data from the image folder (``data.folder``, default the built-in sample
    photos written under ``output``) encoded once with the bundle's VAE and text encoders into the
    latent cache in ``cache_dir`` (read back when it is already there), cropped to aspect-ratio
    buckets with ``data.buckets`` (data a caller prepared: :func:`prepared_run_data`).
    Images too small or too elongated are skipped, and every loss (a caption cut by the text
    encoder, an image upscaled or skipped, a link not followed) is counted in the summary's
    ``lossy`` (``engine/data/checks.py``).

    Args:
        model, seed: the model's source and the run's seed (the cache's identity).
        announce: warn (``TextEncoderWarning``) when captions go through the stand-in embedder,
            and (``DataWarning``) once per kind of loss.

    Raises:
        ModelLoadError: images but no VAE.
        DatasetError: the folder cannot be used (see :func:`~.checks.check_dataset`), or every
            image is skipped.
    """
    text_encoder = describe_text_encoder(bundle.encode_text)
    if text_encoder["kind"] == "stand-in":  # loud: a demo's captions carry no meaning
        text_encoder["warning"] = stand_in_warning(bundle.family)
        if announce:
            warnings.warn(text_encoder["warning"], TextEncoderWarning, stacklevel=4)
    if bundle.vae is None:
        raise ModelLoadError(f"{bundle.source} holds no VAE and the images need one to be encoded: give "
                             "vae_path (--vae-path, a diffusers AutoencoderKL folder), load a diffusers folder, "
                             "or (in ComfyUI) connect latent and conditioning from ComfyUI's encoders")
    data_dir = data.folder or (write_sample_clip(output / "sample_clip") if data.video and bundle.family.frames
                               else write_sample_dataset(output / "sample_data"))  # the built-in default
    dataset = check_dataset(data_dir)  # the run's constructor checked it already: the images' check is cached
    dataset, frames, buckets, summary = _layout(dataset, data, bundle, log)
    if announce:
        warn_lossy(dataset.lossy)
    samples, epoch = dataset.samples, dataset.epoch
    clips = any(s.clip for s in samples)
    windows = [first_window(s, f, data) for s, f in zip(samples, frames)] if clips else None
    cache = prepare_cache(samples, data.resolution, bundle, cache_dir, extra=_cache_identity(model, seed, bundle),
                          buckets=buckets, windows=windows)
    shapes = ", ".join(str(shape) for shape, _ in shape_classes(cache))
    what = f"{len(samples)} images" if not clips else f"{len(samples)} samples ({sum(s.clip for s in samples)} clips)"
    log(f"data: {what} ({len(epoch)} per epoch) from {data_dir} at {data.resolution}px, "
        f"latents {shapes}{_skipped_text(dataset)}{_lossy_text(summary)}")
    drawn = None
    if clips and data.frame_sampling == "random":
        vae, video = bundle.vae, bundle.family.video_latents
        drawn = RandomWindows(samples, frames, buckets, lambda pixels: encode_latents(vae, pixels, video).float(),
                               seed, data.frame_rate)
    empty = empty_caption(bundle.encode_text, cache) if data.caption_dropout > 0 else None
    return RunData(cache, epoch, summary, text_encoder, dataset, drawn, empty)


def _layout(dataset: DatasetScan, data: DataConfig, bundle: ModelBundle, log: Callable[[str], None]
            ) -> tuple[DatasetScan, list[int], list[Bucket] | None, dict[str, Any]]:
    """The samples the run keeps of ``dataset`` (clips too short, images too small or too elongated
    skipped; captions the text encoder cuts counted), each one's frame count and bucket (None: the
    ``resolution`` square, no clips), and the dataset summary (buckets and frames included)."""
    dataset, frames = choose_frames(dataset, data, bundle.family)  # clips too short (or of an image family) skipped
    buckets = left_out = None
    if data.buckets:
        multiple = pixel_multiple(bundle.family, bundle.transformer.config, bundle.vae)
        candidates, left_out = _bucket_candidates(data.resolution, bundle, multiple)
        buckets = assign_buckets(dataset.samples, data.resolution, multiple, candidates)
    targets = ([(data.resolution, data.resolution)] * len(dataset.samples) if buckets is None
               else [(b.width, b.height) for b in buckets])
    dataset, kept = screen_sizes(dataset, targets)
    dataset = _count_truncated(dataset, bundle)
    samples, frames = dataset.samples, [frames[i] for i in kept]
    summary = dataset.summary()
    if buckets is not None:
        buckets = [buckets[i] for i in kept]
    if any(s.clip for s in samples) or data.video:  # a frame bucket per sample: a batch never mixes frame counts
        squares = [Bucket(data.resolution, data.resolution)] * len(samples)
        buckets = [replace(b, frames=f) for b, f in zip(buckets or squares, frames)]
        summary["frames"] = frames_summary(samples, frames, dataset.epoch, data)
    if data.buckets:
        summary["buckets"] = _bucket_summary(buckets, multiple, bundle, dataset, log, left_out)
        if left_out:
            summary["buckets_left_out"] = left_out
    return dataset, frames, buckets, summary


def empty_caption(encode_text: Callable[[list[str]], TextBatch], cache: dict[str, torch.Tensor]) -> TextBatch:
    """The empty caption's conditioning for ``caption_dropout``: ``""`` through the text encoder that
    encoded the cache's captions, ``seq (1, L, D)``, ``mask (1, L)``, ``pooled (1, P)``, with the
    cache's token length ``L`` (a shorter sequence zero-padded, its mask False there, as a batch
    pads its shorter captions; padding past ``L`` dropped).

    Raises:
        DatasetError: the empty caption has more real tokens than the cache holds per caption.
    """
    text = encode_text([""])
    length = cache["text_seq"].shape[1]
    seq, mask = text.seq.float(), text.mask
    if bool(mask[:, length:].any()):
        raise DatasetError(f"the empty caption encodes to {int(mask.sum())} tokens, more than the {length} the "
                           "captions were encoded to: caption_dropout cannot use it")
    seq, mask = seq[:, :length], mask[:, :length]
    seq = torch.nn.functional.pad(seq, (0, 0, 0, length - seq.shape[1]))
    mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]), value=False)
    return TextBatch(seq, mask, None if text.pooled is None else text.pooled.float())


def _bucket_candidates(resolution: int, bundle: ModelBundle, multiple: int
                       ) -> tuple[list[Bucket], dict[str, Any] | None]:
    """The candidate aspect-ratio buckets the model takes and, when its limits
    (``engine/families/limits.py``) leave some out, what was left out (``{"buckets": ["WxH", ...],
    "count", "limit"}``; warned once, naming them).

    Raises:
        ConfigError: no candidate bucket fits the model's limits.
    """
    family, model_config = bundle.family, bundle.transformer.config
    downscale, patch = vae_downscale(bundle.vae), token_patch(family, model_config)
    limits = model_limits(family, model_config)
    kept, left = split_buckets(make_buckets(resolution, multiple), limits, downscale, patch)
    if not kept:
        best = largest_square(limits, patch, downscale, resolution)
        raise ConfigError(f"resolution={resolution} is invalid with buckets for {family.name} ({bundle.source}): "
                          f"allowed at most {best} ({describe_bound(limits, patch, downscale)}): no bucket fits")
    if not left:
        return kept, None
    names = [b.key for b in left]
    left_out = {"buckets": names, "count": len(names), "limit": describe_bound(limits, patch, downscale)}
    warnings.warn(f"buckets: {len(names)} of {len(kept) + len(names)} candidate buckets left out, past what "
                  f"{family.name} takes ({left_out['limit']}): {', '.join(names)}", DataWarning, stacklevel=4)
    return kept, left_out


def _count_truncated(dataset: DatasetScan, bundle: ModelBundle) -> DatasetScan:
    """``dataset`` with the captions the bundle's text encoder cuts in ``lossy["caption_truncated"]``."""
    cut = caption_overflow(bundle.encode_text, [s.caption for s in dataset.samples])
    names = [f"{relative_name(dataset, s.image)} (caption: {why})" for s, why in zip(dataset.samples, cut) if why]
    return replace(dataset, lossy={**dataset.lossy, "caption_truncated": names})


def _bucket_summary(buckets: list[Bucket], multiple: int, bundle: ModelBundle, dataset: DatasetScan,
                    log: Callable[[str], None], left_out: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The buckets' summary (logged; for ``report.json``)."""
    family, model_config = bundle.family, bundle.transformer.config
    summary = bucket_summary(buckets, dataset.epoch, vae_downscale(bundle.vae), token_patch(family, model_config))
    dropped = f"; {left_out['count']} buckets past the model's limits left out" if left_out else ""
    log(f"{describe_buckets(summary)}; sides in multiples of {multiple} px{dropped}")
    return summary


def _lossy_text(summary: dict[str, Any]) -> str:
    """``; lossy: 1 caption_truncated, 2 image_skipped`` or nothing."""
    parts = [f"{n} {kind}" for kind, n in summary["lossy"].items() if n]
    return f"; lossy: {', '.join(parts)}" if parts else ""


def make_sampler(cache: dict[str, torch.Tensor], epoch: list[int], batch_size: int, seed: int,
                 position: dict[str, int]) -> EpochSampler | BucketSampler:
    """The batches of a run: :class:`BucketSampler` when the cache holds several latent shapes
    (buckets), else :class:`EpochSampler` (the order of runs without buckets is unchanged)."""
    if len(shape_classes(cache)) == 1:
        return EpochSampler(len(epoch), batch_size, seed, **position)
    return BucketSampler(bucket_groups(cache, epoch), batch_size, seed, **position)


def _skipped_text(dataset: DatasetScan) -> str:
    """``; skipped 2 hidden or system files, 1 other folders (raw)`` or nothing."""
    parts = [f"{n} {reason}" for reason, n in dataset.skipped.items() if n]
    folders = f" ({', '.join(dataset.ignored_folders)})" if dataset.ignored_folders else ""
    return f"; skipped {', '.join(parts)}{folders}" if parts else ""


def _cache_identity(model: ModelConfig, seed: int, bundle: ModelBundle) -> str:
    """What the cached latents and text embeddings depend on besides the images: the family, the
    model source and its weight files (names, sizes, mtimes), and the seed (a preset's random VAE
    and the deterministic embedder are seeded)."""
    parts = [bundle.family.name, bundle.source, f"seed={seed}",
             f"text={json.dumps(describe_text_encoder(bundle.encode_text), sort_keys=True, default=str)}"]
    for folder in (model.model_path, model.model_file, model.vae_path, *(model.text_encoder_path or ())):
        if folder:
            for path in [Path(folder)] if Path(folder).is_file() else sorted(Path(folder).rglob("*")):
                if path.is_file():
                    stat = path.stat()
                    parts.append(f"{path}|{stat.st_size}|{stat.st_mtime_ns}")
    return "\n".join(parts)
