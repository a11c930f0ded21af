"""Clips: video files decoded with PyAV, animated GIF / WebP with Pillow, on the CPU.

A clip is read as a viewer plays it: every frame decoded in presentation order, converted to RGB
(``engine/data/images.py`` ``to_rgb``), resized to cover the training size and centre-cropped like
an image. The frames a sample trains on (:func:`frame_indices`) follow the run's options
(``engine/config/data.py``): resampled to ``frame_rate`` as ffmpeg's ``fps`` filter does with its
default ``round=near`` (:func:`resampled_frames`, :func:`source_frame`), then ``first`` (the first
window), ``uniform`` (frames evenly spread over the clip, first and last included) or ``random`` (a
window starting at a position drawn from the run's seed; :func:`random_start`).

Rates are exact: a container's rate is PyAV's ``Fraction`` (``average_rate``), a written
``frame_rate`` is read by ``engine/config/data.py`` ``exact_rate`` (23.976 is 24000/1001), and
every count and index is computed on fractions, with half a frame of tolerance where a time falls
between frames.

A clip is decoded to its end: a file cut short (a copy or download that stopped) decodes fewer
frames than its container states (the frame count of an mp4 / mov / avi, else the stated duration
times the rate) or stops at a damaged packet. Its frames up to the damage train (the first frame
missing ends them), and :func:`probe_clip` says why in ``ClipInfo.ended_early``
(``engine/data/checks.py`` counts it ``clip_truncated``); a clip of which no frame decodes is refused.

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
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence

from ..config import derived_seed
from ..config.data import exact_rate
from ..families.lazy import lazy_imports
from ..files.atomic import atomic_write_bytes, atomic_write_text
from .folder import ANIMATED_SUFFIXES, DatasetError
from .images import to_rgb

DEFAULT_FPS = Fraction(16)
"""Frame rate of an animated image that states no frame duration (Wan's training rate)."""
HALF = Fraction(1, 2)
"""Half a frame: the tolerance of every comparison of times (see the module docstring)."""
GAP = Fraction(3, 2)
"""In a clip that ends early, a step between frames longer than this many frames (1.5) is a frame
missing: the frames after it are dropped with the damaged tail."""


@dataclass(frozen=True)
class ClipInfo:
    """What a clip holds, read through its last frame.

    Attributes:
        frames: frames that decode (of a clip that ends early: up to the first one missing).
        fps: frames per second, exact (a container's average rate; an animated image's from its
            frame durations).
        width, height: pixels of a frame.
        ended_early: why the clip holds fewer frames than its file states (``5 of the 12 frames its
            container states decode``), else None.
    """

    frames: int
    fps: Fraction
    width: int
    height: int
    ended_early: str | None = None


def probe_clip(path: Path) -> ClipInfo:
    """:class:`ClipInfo` of a clip after decoding every frame (a file of which no frame decodes is
    refused here, before any model is built). Cached per file version (path, size, mtime).

    Raises:
        DatasetError: the file cannot be decoded, or holds no frame (the message names the file).
    """
    stat = path.stat()
    return _probe(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _probe(path: str, nbytes: int, mtime_ns: int) -> ClipInfo:
    return _decode(Path(path), {0})[0]


def _decode(path: Path, keep: set[int]) -> tuple[ClipInfo, dict[int, Image.Image]]:
    """The clip's :class:`ClipInfo` and its frames ``keep`` and 0 (by index; the others decoded
    and dropped), RGB.

    Raises:
        DatasetError: not decodable, or no frame.
    """
    keep = keep | {0}  # its size
    try:
        if path.suffix.lower() in ANIMATED_SUFFIXES:
            frames, times, rate, stated, stopped = _decode_animated(path, keep)
        else:
            frames, times, rate, stated, stopped = _decode_video(path, keep)
    except DatasetError:
        raise
    except Exception as exc:  # PyAV raises av.error.* (InvalidDataError, EOFError, ...), Pillow OSError
        raise DatasetError(f"clip {str(path)!r} could not be decoded: {exc}") from exc
    count, ended_early = _surviving(times, rate, stated, stopped)
    if not count:
        raise DatasetError(f"clip {str(path)!r} could not be decoded: {_why(stopped)}" if stopped else
                           f"clip {str(path)!r} is truncated: none of the {math.floor(stated + HALF)} frames its "
                           "container states decodes" if stated else f"clip {str(path)!r} holds no frame")
    frames = {i: frame for i, frame in frames.items() if i < count}
    return ClipInfo(count, rate, *frames[0].size, ended_early), frames


def _surviving(times: list[Fraction | None], rate: Fraction, stated: Fraction | None,
               stopped: Exception | None) -> tuple[int, str | None]:
    """``(frames that train, why the clip ends early or None)`` of a clip whose decoded frames
    start at ``times`` (seconds; None: unknown), given the frames its file states (``stated``,
    None: unknown) and the error that stopped decoding (``stopped``).

    A clip ends early when it decodes more than half a frame fewer than stated, or (nothing
    stated) when an error stopped it; its frames then end at the first one missing (a step of more
    than :data:`GAP` frames between two decoded frames: a packet of the damaged tail lost).
    """
    decoded = len(times)
    short = decoded < stated - HALF if stated is not None else stopped is not None
    if not short:
        return decoded, None
    count = next((k for k in range(1, decoded) if None not in times[k - 1:k + 1]
                  and (times[k] - times[k - 1]) * rate > GAP), decoded)
    what = (f"{count} of the {math.floor(stated + HALF)} frames its container states decode" if stated is not None
            else f"{count} frame{'s' if count != 1 else ''} decode{'s' if count == 1 else ''}")
    if count < decoded:
        what += f" (a frame is missing after frame {count}: the {decoded - count} after it dropped)"
    return count, what + (f"; decoding stopped: {_why(stopped)}" if stopped else "")


def _why(error: Exception) -> str:
    """An error in words: FFmpeg's message without its error number."""
    return str(getattr(error, "strerror", None) or error)


def _decode_video(path: Path, keep: set[int]):
    """``(frames kept by index, every frame's start in seconds, rate, frames the container
    states, the error that stopped decoding)`` of a video file (PyAV)."""
    with lazy_imports():
        import av

    frames, times, stopped = {}, [], None
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise DatasetError(f"clip {str(path)!r} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate or DEFAULT_FPS
        try:
            for frame in _frames(container.demux(stream)):
                if len(times) in keep:
                    frames[len(times)] = frame.to_image().convert("RGB")
                times.append(frame.pts * frame.time_base if frame.pts is not None and frame.time_base else None)
        except (av.error.FFmpegError, _Damaged) as exc:  # a packet cut short or damaged: the frames before it stand
            stopped = exc
        stated = _stated_frames(stream, container.duration, rate, av.time_base)
    return frames, times, Fraction(rate), stated, stopped


class _Damaged(Exception):
    """A packet or frame that FFmpeg flags corrupt: decoding stops before it."""


def _frames(packets):
    """The frames the packets decode to, in presentation order, up to the first packet the
    demuxer flags corrupt (an avi packet cut short: not decoded, nor the frames it would let out)
    or frame the decoder flags corrupt (concealed).

    Raises:
        _Damaged: at that packet or frame. av.error.FFmpegError: a packet the decoder refuses.
    """
    for packet in packets:
        if getattr(packet, "is_corrupt", False):
            raise _Damaged(f"a packet at byte {packet.pos} is cut short or damaged")
        for frame in packet.decode():
            if getattr(frame, "is_corrupt", False):
                raise _Damaged(f"the frame at {float(frame.time or 0):.3f} s is damaged")
            yield frame


def _stated_frames(stream, container_duration: int | None, rate: Fraction, time_base: int) -> Fraction | None:
    """Frames a video file states before it is decoded: the stream's frame count (mp4, mov, avi),
    else its duration (the stream's, else the container's: mkv, webm) times ``rate``, else None."""
    if stream.frames:
        return Fraction(stream.frames)
    if stream.duration and stream.time_base:
        return stream.duration * stream.time_base * rate
    if container_duration:
        return Fraction(container_duration, time_base) * rate
    return None


def _decode_animated(path: Path, keep: set[int]):
    """As :func:`_decode_video`, of an animated GIF / WebP (Pillow): its rate from the frame
    durations; a file states no frame count, so only an error (a GIF cut short) ends it early."""
    frames, durations, stopped = {}, [], None
    with Image.open(path) as image:
        try:
            for i, frame in enumerate(ImageSequence.Iterator(image)):
                frame.load()  # every frame's pixels, kept or not
                if i in keep:
                    frames[i] = to_rgb(frame.copy())
                durations.append(frame.info.get("duration") or 0)
        except Exception as exc:  # a GIF cut short: OSError "image file is truncated", IndexError, ...
            if not durations:
                raise
            stopped = exc
    known = [d for d in durations if d > 0]
    rate = Fraction(1000 * len(known), sum(known)) if known else DEFAULT_FPS
    return frames, [None] * len(durations), rate, None, stopped


def resampled_frames(frames: int, fps: Fraction | float, frame_rate: Fraction | float | None) -> int:
    """Frames a clip of ``frames`` at ``fps`` gives at ``frame_rate`` (None: its own): the output
    frames whose middle lies within the clip, ``floor(frames * frame_rate / fps + 1/2)``, at least
    1; ``frames`` itself at the clip's own rate. Exact (rates through ``exact_rate``)."""
    if frame_rate is None:
        return frames
    return max(1, math.floor(frames * exact_rate(frame_rate) / exact_rate(fps) + HALF))


def source_frame(position: int, fps: Fraction | float, frame_rate: Fraction | float) -> int:
    """The source frame output frame ``position`` (at ``position / frame_rate`` s) shows when a
    clip at ``fps`` is resampled to ``frame_rate``: the last one starting less than half an output
    frame after it, ``ceil((position + 1/2) * fps / frame_rate) - 1`` (ffmpeg's ``fps`` filter,
    ``round=near``: each frame's time rounded to the nearest output frame, the last one of a slot
    kept; equal rates keep every frame). Exact."""
    return max(0, math.ceil((position + HALF) * exact_rate(fps) / exact_rate(frame_rate)) - 1)


def available_frames(info: ClipInfo, frame_rate: Fraction | float | None) -> int:
    """Frames the clip gives at ``frame_rate`` (None: its own): :func:`resampled_frames`."""
    return resampled_frames(info.frames, info.fps, frame_rate)


def frame_indices(info: ClipInfo, count: int, frame_rate: Fraction | float | None, sampling: str,
                  start: int = 0) -> list[int]:
    """The source frame indices of one training window.

    Args:
        info: the clip (:func:`probe_clip`).
        count: pixel frames to take (at most :func:`available_frames`).
        frame_rate: resample to this fps first (None: the clip's own; :func:`source_frame`).
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
        positions = [0] if count == 1 else [round(Fraction(j * (total - 1), count - 1)) for j in range(count)]
    else:
        begin = start if sampling == "random" else 0
        positions = list(range(begin, begin + count))
    if frame_rate is None:
        return positions
    return [min(info.frames - 1, source_frame(p, info.fps, frame_rate)) for p in positions]


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
    _, decoded = _decode(path, set(indices))
    if not decoded.keys() >= set(indices):
        raise DatasetError(f"clip {str(path)!r} gave {len(decoded)} of the frames {sorted(set(indices))}: it changed "
                           "or is damaged")
    return frames_to_pixels([decoded[i] for i in indices], size)


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
