"""What the data is checked for, and what of it a run loses, counted.

:func:`check_dataset` is the cheap pass over a data folder that runs before any model is built:
the scan (``engine/data/folder.py``: every caption decoded), then every image read through to its
last byte by Pillow (a PNG's chunks and checksums through ``verify()``, other formats decoded,
JPEG at 1/8 scale through ``draft``), so a text file named ``x.png`` or a PNG cut in half is
refused in one line naming the file before the run loads anything, and every clip decoded to its
end (``engine/data/video.py``: one cut short trains on the frames that decode, counted).

The size rule (:func:`fit_loss`). An image is resized to cover its training size (the
``resolution`` square, or its bucket) and centre-cropped (``engine/data/images.py``); ``scale`` is
that resize factor. The field's trainers bracket the choice: kohya-ss sd-scripts upscales small
images unless ``bucket_no_upscale`` is set (then no image is ever enlarged), SimpleTuner skips
images smaller than its ``minimum_image_size``. Here:

- ``scale`` above :data:`UPSCALE_COUNTED` (2x): trained, counted ``image_upscaled`` (the image is
  blurred: it supplies less than a quarter of the pixels it fills);
- ``scale`` above :data:`UPSCALE_SKIPPED` (8x, less than 1/64 of the pixels: a 1x1 image, a 32 px
  one at 256) or an aspect ratio beyond :data:`ASPECT_SKIPPED` (8:1, twice the widest bucket's
  4:1, so even a bucket would crop away more than half of it; 10000x10): skipped, counted
  ``image_skipped``.

Every loss (:data:`~.folder.LOSSY_KINDS`) is counted in ``report.json`` ``dataset.lossy`` with the
first :data:`~.folder.NAMED` entries in ``dataset.lossy_files``, and warned once per kind per run
(:func:`warn_lossy`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

from .buckets import MAX_ASPECT
from .folder import LOSSY_KINDS, NAMED, DatasetError, DatasetScan, DataWarning, scan_dataset
from .images import check_image
from .video import probe_clip

UPSCALE_COUNTED = 2.0
"""An image resized by more than this to cover its training size is counted ``image_upscaled``."""
UPSCALE_SKIPPED = 8.0
"""An image resized by more than this is skipped (``image_skipped``)."""
ASPECT_SKIPPED = 2 * MAX_ASPECT
"""An image more elongated than this (long side / short side) is skipped: 8:1."""


def check_dataset(folder: str | Path | None) -> DatasetScan | None:
    """The scan of the data ``folder`` with every image checked and its size known, and every clip
    decoded to its end (its frames and rate known; one that ends early counted ``clip_truncated``:
    ``engine/data/video.py``) (None without a folder: the built-in photos are written by the run).
    Runs before any model is built.

    Raises:
        DatasetError: see :func:`~.folder.scan_dataset` and :func:`~.images.check_image`.
    """
    if folder is None:
        return None
    scan = scan_dataset(folder)
    samples, ended = [], []
    for sample in scan.samples:
        if not sample.clip:
            samples.append(replace(sample, size=check_image(sample.image)))
            continue
        info = probe_clip(sample.image)
        samples.append(replace(sample, size=(info.width, info.height), frames=info.frames, fps=info.fps))
        if info.ended_early:
            ended.append(f"{relative_name(scan, sample.image)} ({info.ended_early})")
    return replace(scan, samples=samples, lossy={**scan.lossy, "clip_truncated": ended})


def fit_loss(size: tuple[int, int], target: tuple[int, int]) -> tuple[str, str] | None:
    """What fitting an image of ``size`` to ``target`` (both ``(width, height)`` pixels) loses:
    ``("image_skipped", why)``, ``("image_upscaled", "3.2x")`` or None (see the module docstring)."""
    (width, height), (tw, th) = size, target
    scale = max(tw / width, th / height)
    aspect = max(width, height) / min(width, height)
    if aspect > ASPECT_SKIPPED:
        return "image_skipped", f"aspect {aspect:.4g}:1, more than {ASPECT_SKIPPED:g}:1"
    if scale > UPSCALE_SKIPPED:
        return "image_skipped", f"{width}x{height} px upscaled {scale:.3g}x to {tw}x{th}, more than {UPSCALE_SKIPPED:g}x"
    if scale > UPSCALE_COUNTED:
        return "image_upscaled", f"{scale:.3g}x to {tw}x{th}"
    return None


def screen_sizes(scan: DatasetScan, targets: list[tuple[int, int]]) -> tuple[DatasetScan, list[int]]:
    """The scan without the images :func:`fit_loss` skips, its ``lossy`` entries added, and the
    indices of the samples kept.

    Args:
        scan: a checked scan (each sample's ``size`` known).
        targets: each sample's training size ``(width, height)`` in pixels.

    Raises:
        DatasetError: every image is skipped (the first named).
    """
    lossy = {kind: list(names) for kind, names in scan.lossy.items()}
    kept = []
    for i, (sample, target) in enumerate(zip(scan.samples, targets)):
        loss = fit_loss(sample.size, target)
        if loss is not None:
            lossy[loss[0]].append(f"{relative_name(scan, sample.image)} ({loss[1]})")
        if loss is None or loss[0] != "image_skipped":
            kept.append(i)
    if not kept:
        raise DatasetError(f"data={str(scan.root)!r}: every image is too small or too elongated to train "
                           f"({len(scan.samples)} skipped, e.g. {lossy['image_skipped'][0]})")
    return replace(scan, samples=[scan.samples[i] for i in kept], lossy=lossy), kept


def relative_name(scan: DatasetScan, path: Path) -> str:
    """How the report and the warnings name a file of the dataset: relative to its folder, ``/``-separated."""
    try:
        return path.relative_to(scan.root).as_posix()
    except ValueError:
        return str(path)


_WHAT = {"caption_truncated": "captions longer than the text encoder reads were cut",
         "image_upscaled": f"images were upscaled more than {UPSCALE_COUNTED:g}x to their training size (blurred)",
         "image_skipped": (f"images were skipped (upscaled more than {UPSCALE_SKIPPED:g}x, or more elongated than "
                           f"{ASPECT_SKIPPED:g}:1)"),
         "link_not_followed": "links were not followed (each real folder is read once)",
         "clip_truncated": "clips end before the frames their file states (each trains on the frames that decode)",
         "clip_skipped": "clips were skipped (fewer frames than the smallest frame count or min_frames, or an image "
                         "family's data)"}


def warn_lossy(lossy: dict[str, list[str]]) -> None:
    """One :class:`~.folder.DataWarning` per kind that happened, with its count and first entries."""
    for kind in LOSSY_KINDS:
        names = lossy.get(kind) or []
        if names:
            more = f", and {len(names) - NAMED} more" if len(names) > NAMED else ""
            warnings.warn(f"data: {len(names)} {_WHAT[kind]} ({kind}): {'; '.join(names[:NAMED])}{more}",
                          DataWarning, stacklevel=3)
