"""Which frames each sample trains on: its frame count (a frame bucket), the clips skipped, and
the random windows encoded when drawn.

The rule (``engine/config/data.py`` options; anchors: SimpleTuner's video datasets, musubi-tuner's
``target_frames``, diffusion-pipe's frame buckets, ai-toolkit's images as 1-frame clips):

- an image trains as a 1-frame clip;
- a clip of a video family trains at the largest of ``frame_counts`` (``frame_buckets``, else
  ``num_frames``) it holds at ``frame_rate`` (:func:`~.video.available_frames`); a clip holding
  fewer than ``min_frames`` (unset: the smallest count) or than every count is skipped and counted
  ``clip_skipped``, never padded;
- an image family's data keeps its images; its clips are skipped and counted (it trains images).

With ``frame_sampling=random`` the latent cache holds each clip's first window (its shape is what
buckets, previews and the planner read); each time a batch is drawn, :class:`RandomWindows` draws
its clips' windows from the run's seed (:func:`~.video.random_start`: seeded by epoch and position,
so a resumed run draws the windows an uninterrupted run draws) and encodes them with the VAE,
before the step's measured region.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import DataConfig
from ..families import FamilyAdapter
from .buckets import Bucket
from .checks import relative_name
from .folder import DatasetError, DatasetScan, DataWarning, Sample
from .video import ClipInfo, available_frames, frame_indices, load_clip, random_start


def clip_info(sample: Sample) -> ClipInfo:
    """A checked clip's :class:`~.video.ClipInfo` (frames, fps and size of its check)."""
    return ClipInfo(sample.frames, sample.fps or 0.0, *(sample.size or (0, 0)))


def choose_frames(scan: DatasetScan, data: DataConfig, family: FamilyAdapter) -> tuple[DatasetScan, list[int]]:
    """The scan without the clips that cannot train (counted ``clip_skipped``, each named with
    why) and each kept sample's pixel-frame count (see the module docstring).

    Args:
        scan: a checked scan (``engine/data/checks.py``: each clip's frames and fps known).

    Raises:
        DatasetError: every clip of a video family's folder is too short (``min_frames`` named,
            with the longest clip's frames), or an image family's folder holds only clips.
    """
    counts = sorted(data.frame_counts)
    least = data.min_frames or counts[0]
    bound = (f"min_frames={least}" if data.min_frames else
             f"frame_buckets' smallest count {least}" if data.frame_buckets else f"num_frames={least}")
    kept, frames, skipped = [], [], []
    for sample in scan.samples:
        if not sample.clip:
            kept.append(sample)
            frames.append(1)
            continue
        name = relative_name(scan, sample.image)
        if family.frames is None:
            skipped.append(f"{name} (a clip: {family.name} trains images)")
            continue
        have = available_frames(clip_info(sample), data.frame_rate)
        fits = [c for c in counts if c <= have]
        if have < least or not fits:
            rate = f" at {data.frame_rate:g} fps" if data.frame_rate else ""
            skipped.append(f"{name} ({have} frames{rate}, fewer than {bound})")
            continue
        kept.append(sample)
        frames.append(fits[-1])
    lossy = {**scan.lossy, "clip_skipped": scan.lossy.get("clip_skipped", []) + skipped}
    if not kept and family.frames is None:
        raise DatasetError(f"data={str(scan.root)!r} holds only clips ({len(skipped)}): {family.name} trains "
                           "images; use a video family or add images")
    if family.frames is not None and skipped and not any(s.clip for s in kept):  # the clips were the point
        longest = max(available_frames(clip_info(s), data.frame_rate) for s in scan.samples if s.clip)
        raise DatasetError(f"data={str(scan.root)!r}: every clip ({len(skipped)}) is too short: min_frames={least} "
                           f"({'set' if data.min_frames else 'unset: the smallest frame count'}), and the longest "
                           f"clip gives {longest} frames{f' at {data.frame_rate:g} fps' if data.frame_rate else ''}; "
                           "lower num_frames, frame_buckets or min_frames, or add longer clips")
    clips_at_one = sum(1 for s, f in zip(kept, frames) if s.clip and f == 1)
    if clips_at_one and not data.video:
        warnings.warn(f"data: {clips_at_one} clips train on one frame each (num_frames=1): set num_frames "
                      f"(allowed {family.frames.describe()}) to train motion", DataWarning, stacklevel=3)
    return replace(scan, samples=kept, lossy=lossy), frames


def first_window(sample: Sample, count: int, data: DataConfig) -> list[int] | None:
    """The source frame indices a clip's cached window holds (``first`` / ``uniform``; ``random``:
    the first window, replaced when drawn), or None for an image."""
    if not sample.clip:
        return None
    sampling = "uniform" if data.frame_sampling == "uniform" else "first"
    return frame_indices(clip_info(sample), count, data.frame_rate, sampling)


def frames_summary(samples: list[Sample], frames: list[int], epoch: list[int], data: DataConfig) -> dict[str, Any]:
    """``report.json`` ``dataset.frames``: the options, the samples per frame count, and how windows are taken."""
    per_count: dict[str, int] = {}
    for count in frames:
        per_count[str(count)] = per_count.get(str(count), 0) + 1
    windows = ("random windows, encoded when drawn (the cache holds each clip's first window)"
               if data.frame_sampling == "random" else f"{data.frame_sampling} window, encoded once into the cache")
    return {"frame_counts": list(data.frame_counts), "min_frames": data.min_frames, "frame_rate": data.frame_rate,
            "frame_sampling": data.frame_sampling, "samples_per_count": per_count, "windows": windows,
            "clips": sum(s.clip for s in samples), "clips_per_epoch": sum(samples[i].clip for i in epoch)}


@dataclass
class RandomWindows:
    """``frame_sampling=random``: the latents of a batch's windows drawn from the run's seed.

    Attributes:
        samples, frames, buckets: per cache row, the sample, its pixel-frame count and its bucket.
        vae, encode: the VAE and :func:`~.cache.encode_latents`'s caller ``encode(pixels) -> (1, C, F', H', W')``.
        seed, frame_rate: the run's seed and the clips' resampling.
        encoded: windows encoded so far (``report.json`` ``dataset.frames.windows_encoded``).
    """

    samples: list[Sample]
    frames: list[int]
    buckets: list[Bucket]
    encode: Any
    seed: int
    frame_rate: float | None
    encoded: int = 0

    def latents(self, cached: torch.Tensor, rows: list[int], positions: list[int], epoch: int) -> torch.Tensor:
        """``cached`` ``(B, C, F', H', W')`` (the rows' cached latents) with each clip's window
        replaced by the one drawn for (``epoch``, its epoch ``position``); images and clips with a
        single possible window keep their cached latents."""
        out = cached.clone()
        for i, (row, position) in enumerate(zip(rows, positions)):
            sample, count = self.samples[row], self.frames[row]
            info = clip_info(sample)
            if not sample.clip or available_frames(info, self.frame_rate) == count:
                continue
            start = random_start(self.seed, epoch, position, info, count, self.frame_rate)
            if start == 0:
                continue  # the cached first window
            indices = frame_indices(info, count, self.frame_rate, "random", start)
            bucket = self.buckets[row]
            pixels = load_clip(sample.image, indices, (bucket.width, bucket.height))[None]
            out[i] = self.encode(pixels)[0].to(out)
            self.encoded += 1
        return out


def check_clip_frames(scan: DatasetScan | None, data: DataConfig, family: FamilyAdapter) -> None:
    """:func:`choose_frames` before any model is built (its warnings are left to the run).

    Raises:
        DatasetError: see :func:`choose_frames`.
    """
    if scan is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataWarning)
            choose_frames(scan, data, family)


__all__ = ["DatasetError", "RandomWindows", "check_clip_frames", "choose_frames", "first_window", "frames_summary"]
