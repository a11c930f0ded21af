"""Clips: video files decoded with PyAV, animated GIF / WebP with Pillow, on the CPU.

A clip is read as a viewer plays it: every frame decoded in presentation order, converted to RGB
(``engine/data/images.py`` ``to_rgb``), resized to cover the training size and centre-cropped like
an image. The frames a sample trains on (:func:`frame_indices`) follow the run's options
(``engine/config/data.py``): resampled to ``frame_rate`` by taking, for each output time ``j /
frame_rate``, the last source frame shown at that time (``floor(j * fps / frame_rate)``, as
ffmpeg's ``fps`` filter drops and repeats frames), then ``first`` (the first window),
``uniform`` (frames evenly spread over the clip, first and last included) or ``random`` (a window
starting at a position drawn from the run's seed; :func:`random_start`).

Anchors: SimpleTuner's video datasets (``num_frames``, ``min_frames``, short clips dropped),
musubi-tuner's ``frame_extraction`` (head / uniform / chunk / slide), diffusion-pipe's frame
buckets.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence

from ..config import derived_seed
from ..families.lazy import lazy_imports
from ..files.atomic import atomic_write_bytes, atomic_write_text
from .folder import ANIMATED_SUFFIXES, DatasetError
from .images import to_rgb

DEFAULT_FPS = 16.0
"""Frame rate of an animated image that states no frame duration (Wan's training rate)."""


@dataclass(frozen=True)
class ClipInfo:
    """What a clip holds, read through its last frame.

    Attributes:
        frames: decoded frames.
        fps: frames per second (a container's average rate; an animated image's from its
            frame durations).
        width, height: pixels of a frame.
    """

    frames: int
    fps: float
    width: int
    height: int


def probe_clip(path: Path) -> ClipInfo:
    """:class:`ClipInfo` of a clip after decoding every frame (a truncated or damaged file is
    refused here, before any model is built). Cached per file version (path, size, mtime).

    Raises:
        DatasetError: the file cannot be decoded, or holds no frame (the message names the file).
    """
    stat = path.stat()
    return _probe(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _probe(path: str, nbytes: int, mtime_ns: int) -> ClipInfo:
    frames = _decode(Path(path), None)
    first = frames[0][0]
    return ClipInfo(len(frames), frames[0][1], first.width, first.height)


def _decode(path: Path, keep: set[int] | None) -> list[tuple[Image.Image, float]]:
    """``(frame, fps)`` of every frame (``keep``: only those indices, the others decoded and
    dropped), RGB.

    Raises:
        DatasetError: not decodable, or no frame.
    """
    try:
        if path.suffix.lower() in ANIMATED_SUFFIXES:
            found = _decode_animated(path, keep)
        else:
            found = _decode_video(path, keep)
    except DatasetError:
        raise
    except Exception as exc:  # PyAV raises av.error.* (InvalidDataError, EOFError, ...), Pillow OSError
        raise DatasetError(f"clip {str(path)!r} could not be decoded: {exc}") from exc
    if not found and keep is None:
        raise DatasetError(f"clip {str(path)!r} holds no frame")
    return found


def _decode_video(path: Path, keep: set[int] | None) -> list[tuple[Image.Image, float]]:
    with lazy_imports():
        import av

    found = []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise DatasetError(f"clip {str(path)!r} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else DEFAULT_FPS
        stated, decoded = stream.frames, 0
        for i, frame in enumerate(container.decode(stream)):
            decoded += 1
            if keep is None or i in keep:
                found.append((frame.to_image().convert("RGB"), fps))
    if keep is None and stated and decoded < stated:  # cut after its header (a "faststart" mp4): truncated
        raise DatasetError(f"clip {str(path)!r} is truncated: {decoded} of the {stated} frames its header states "
                           "could be decoded")
    return found


def _decode_animated(path: Path, keep: set[int] | None) -> list[tuple[Image.Image, float]]:
    found, durations = [], []
    with Image.open(path) as image:
        for i, frame in enumerate(ImageSequence.Iterator(image)):
            durations.append(frame.info.get("duration") or 0)
            if keep is None or i in keep:
                found.append(to_rgb(frame.copy()))
    known = [d for d in durations if d > 0]
    fps = 1000.0 / (sum(known) / len(known)) if known else DEFAULT_FPS
    return [(frame, fps) for frame in found]


def available_frames(info: ClipInfo, frame_rate: float | None) -> int:
    """Frames the clip gives at ``frame_rate`` (None: its own): ``floor(frames * frame_rate / fps)``,
    at least 1 (see the module docstring)."""
    if frame_rate is None or math.isclose(frame_rate, info.fps):
        return info.frames
    return max(1, math.floor(info.frames * frame_rate / info.fps + 1e-9))


def frame_indices(info: ClipInfo, count: int, frame_rate: float | None, sampling: str, start: int = 0) -> list[int]:
    """The source frame indices of one training window.

    Args:
        info: the clip (:func:`probe_clip`).
        count: pixel frames to take (at most :func:`available_frames`).
        frame_rate: resample to this fps first (None: the clip's own).
        sampling: ``first`` | ``uniform`` | ``random`` (``start``: the window's first resampled
            frame, :func:`random_start`).
        start: see ``sampling``.

    Raises:
        ValueError: ``count`` is more than the clip gives.
    """
    total = available_frames(info, frame_rate)
    if count > total:
        raise ValueError(f"a clip of {total} frames cannot give {count}")
    if sampling == "uniform":
        positions = [0] if count == 1 else [round(j * (total - 1) / (count - 1)) for j in range(count)]
    else:
        begin = start if sampling == "random" else 0
        positions = list(range(begin, begin + count))
    step = 1.0 if frame_rate is None else info.fps / frame_rate
    return [min(info.frames - 1, math.floor(p * step + 1e-9)) for p in positions]


def random_start(seed: int, epoch: int, position: int, info: ClipInfo, count: int, frame_rate: float | None) -> int:
    """The first resampled frame of a ``random`` window: uniform over the clip's possible starts,
    drawn from a generator seeded by the run seed plus a hash of (epoch, epoch position) (a stream
    apart from the sampler's ``seed + epoch``), so a resumed run draws the windows an uninterrupted
    run draws."""
    starts = available_frames(info, frame_rate) - count + 1
    offset = int.from_bytes(hashlib.sha256(f"frames|{epoch}|{position}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(derived_seed(seed, offset))
    return int(torch.randint(starts, (1,), generator=generator))


def fit_frame(frame: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """One frame resized to cover ``size = (width, height)`` and centre-cropped, as images are
    (``engine/data/images.py`` ``load_image``): ``(3, H, W)`` float in [-1, 1]."""
    fitted = ImageOps.fit(to_rgb(frame), size, method=Image.Resampling.LANCZOS)
    array = np.asarray(fitted, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def frames_to_pixels(frames: list[Image.Image], size: tuple[int, int]) -> torch.Tensor:
    """Frames as one clip for the VAE: ``(3, F, H, W)`` float in [-1, 1] (:func:`fit_frame` each)."""
    return torch.stack([fit_frame(f, size) for f in frames], dim=1)


def load_clip(path: Path, indices: list[int], size: tuple[int, int]) -> torch.Tensor:
    """The frames ``indices`` of a clip (repeats allowed), fitted to ``size``: ``(3, F, H, W)`` in [-1, 1].

    Raises:
        DatasetError: the file cannot be decoded, or holds fewer frames than asked.
    """
    decoded = _decode(path, set(indices))
    wanted = sorted(set(indices))
    if len(decoded) != len(wanted):
        raise DatasetError(f"clip {str(path)!r} gave {len(decoded)} of the frames {wanted}: it changed or is damaged")
    by_index = dict(zip(wanted, (frame for frame, _ in decoded)))
    return frames_to_pixels([by_index[i] for i in indices], size)


SAMPLE_CLIP = ("astronaut", "a slow camera pan across a portrait photo of an astronaut", 33, 16)
"""The built-in sample clip: the ``skimage.data`` photo, its caption, its frames and frames per second."""


def write_sample_clip(folder: str | Path) -> Path:
    """Write the built-in sample clip with its caption into ``folder`` (idempotent, atomic): an H.264
    mp4 (PyAV) of a 256 px window panning across a scikit-image photograph, 33 frames at 16 fps."""
    with lazy_imports():
        import av
        import skimage.data

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    photo, caption, count, fps = SAMPLE_CLIP
    path = folder / f"{photo}_pan.mp4"
    if path.exists():
        return folder
    image = Image.fromarray(getattr(skimage.data, photo)()).convert("RGB")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width = stream.height = 256
        stream.pix_fmt = "yuv420p"
        for i in range(count):
            frame = image.crop((i * 6, i * 3, i * 6 + 256, i * 3 + 256))
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    atomic_write_text(folder / f"{photo}_pan.txt", caption + "\n")
    atomic_write_bytes(path, buffer.getvalue())
    return folder
