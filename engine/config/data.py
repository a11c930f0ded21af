"""The training data of a run: the image folder, the size images are cropped to, the buckets and
the batch (read by ``engine/data/``)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .options import UNSET_WORDS, ConfigError, check_options, option

MAX_RESOLUTION = 8192
MAX_BATCH = 1024
MAX_FRAMES = 1024
FRAME_SAMPLING = ("first", "uniform", "random")
FRAME_KEYS = ("num_frames", "frame_rate", "frame_sampling", "frame_buckets", "min_frames")
"""The frame options of a data source (the Dataset node's frame widgets)."""
NTSC = Fraction(1000, 1001)
"""The NTSC factor: 23.976, 29.97 and 59.94 fps are 24, 30 and 60 x 1000/1001 (SMPTE ST 12-1)."""
NTSC_TOLERANCE = Fraction(1, 200)
"""A written rate within this (0.005 fps) of ``n x 1000/1001`` means that NTSC rate."""


def exact_rate(value: float | int | Fraction) -> Fraction:
    """A frame rate as exact frames per second: a ``Fraction`` as it is (a container's rate); an
    integer as it is; a decimal within :data:`NTSC_TOLERANCE` of ``n x 1000/1001`` as that NTSC rate
    (23.976 and 23.98 -> 24000/1001, 29.97 -> 30000/1001, 59.94 -> 60000/1001, 47.952, 119.88);
    any other decimal as the decimal written (12.5 -> 25/2, 23.5 -> 47/2).

    The rule reads a rate as cameras and editors label it (24000/1001 is shown as "23.976" or
    "23.98"): read as the decimal 2997/125, ``frame_rate=23.976`` would resample a 24000/1001 clip
    to a rate 0.0001% off its own instead of keeping its frames.
    """
    if isinstance(value, Fraction):
        return value
    rate = Fraction(repr(float(value))) if isinstance(value, float) else Fraction(value)
    if rate.denominator == 1:
        return rate
    ntsc = round(rate / NTSC) * NTSC
    return ntsc if ntsc > 0 and abs(rate - ntsc) < NTSC_TOLERANCE else rate


def _frame_list(value: Any) -> Any:
    """``frame_buckets``: frame counts as a list of integers, or a comma/space-separated string
    (``"5, 9, 13"``: the CLI and the node's text widget), sorted and unique; unset stays unset."""
    if value is None or isinstance(value, str) and value.strip().lower() in UNSET_WORDS:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = " ".join(value)  # the CLI's words: --frame-buckets 5 9 or 5,9
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    try:
        counts = [int(v) if isinstance(v, str) else v for v in items]
    except (TypeError, ValueError):
        counts = None
    if (not isinstance(items, (list, tuple)) or not counts or counts is None
            or not all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_FRAMES for c in counts)):
        raise ConfigError(f"frame_buckets={value!r} is invalid: allowed frame counts from 1 to {MAX_FRAMES} (5 9 17, "
                          "or 5,9,17), or unset.")
    return tuple(sorted(set(counts)))


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how they are batched. Validated at construction.

    Raises:
        ConfigError: a field is out of range, ``resolution`` is not a multiple of 16, or both
            ``batch_size`` and ``global_batch_size`` are set.
    """

    folder: str | None = option(None, "Folder of images with same-name .txt captions; default: built-in sample "
                                "photographs.", "--data", key="data")
    resolution: int = option(256, "Square training resolution in pixels (centre crop + resize); a multiple of 16. "
                             "With buckets: the side of the square whose pixel area every bucket keeps.",
                             "--resolution", min=16, max=MAX_RESOLUTION, multiple=16)
    buckets: bool = option(False, "Aspect-ratio buckets: each image is cropped to the bucket of its nearest aspect "
                           "ratio (about resolution x resolution pixels, 1:4 to 4:1, sides in the multiples the "
                           "model needs) instead of the square; a batch never mixes buckets. Image folders only "
                           "(not ComfyUI latents).", "--buckets")
    num_frames: int = option(1, "Pixel frames per clip of a video family (video files and animated GIF/WebP in the "
                             "data folder; images train as 1-frame clips). The family's VAE rule applies (Wan, "
                             "HunyuanVideo: 4k+1; LTX-Video: 8k+1); image families take 1.", "--num-frames",
                             min=1, max=MAX_FRAMES)
    frame_rate: float | None = option(None, "Frames per second clips are resampled to before frames are taken "
                                      "(nearest frame in time, as ffmpeg's fps filter); 23.976, 29.97, 59.94 mean "
                                      "the NTSC rates 24000/1001, 30000/1001, 60000/1001; unset: each clip's own "
                                      "rate.", "--frame-rate", above=0, max=1000)
    frame_sampling: str = option("first", "Which frames of a clip train: first = the first window; uniform = "
                                 "frames spread evenly over the whole clip; random = a window drawn each epoch from "
                                 "the run's seed (resume-exact; encoded when drawn).", "--frame-sampling",
                                 choices=FRAME_SAMPLING)
    frame_buckets: tuple[int, ...] | None = option(None, "Frame counts a clip may train at instead of num_frames: "
                                                   "each clip goes to the largest count it holds (SimpleTuner / "
                                                   "diffusion-pipe frame buckets); a batch never mixes counts.",
                                                   "--frame-buckets", parse=_frame_list,
                                                   allowed=f"frame counts from 1 to {MAX_FRAMES} (5 9 17, or 5,9,17), "
                                                           "or unset")
    min_frames: int | None = option(None, "Clips with fewer frames (at frame_rate) are skipped and counted; unset: "
                                    "the smallest training count. May exceed it (only clips this long train, at the largest count they hold). "
                                    "Never padded.", "--min-frames", min=1,
                                    max=MAX_FRAMES)
    batch_size: int = option(1, "Images per micro-batch on each process (with fsdp or ddp on N processes the global batch "
                             "is batch_size x N, as SimpleTuner's train_batch_size, accelerate and kohya count it).",
                             "--batch-size", min=1, max=MAX_BATCH)
    global_batch_size: int | None = option(
        None, "Images per micro-batch over all processes, instead of batch_size: with fsdp or ddp on N processes each trains "
        "global_batch_size / N of them (a multiple of N); one process trains them all. Unset: batch_size per process.",
        "--global-batch-size", min=1, max=MAX_BATCH)
    caption_dropout: float = option(0.0, "Probability that a sample trains with the empty caption's conditioning "
                                    "instead of its own (encoded once by the same text encoder); drawn per sample "
                                    "and step from the run's seed (resume-exact), counted in report.json. Needs "
                                    "captions encoded here (an image folder).", "--caption-dropout", min=0, max=1,
                                    step=0.01)

    def __post_init__(self) -> None:
        check_options(self)
        if self.global_batch_size is not None and self.batch_size != 1:
            raise ConfigError(f"global_batch_size={self.global_batch_size!r} is invalid with batch_size="
                              f"{self.batch_size!r}: allowed unset when batch_size is set (give one of them: "
                              "batch_size per process, or global_batch_size over all processes).")

    @property
    def frame_counts(self) -> tuple[int, ...]:
        """The pixel-frame counts clips train at: ``frame_buckets``, else ``(num_frames,)``."""
        return self.frame_buckets or (self.num_frames,)

    @property
    def rate(self) -> Fraction | None:
        """``frame_rate`` as exact frames per second (:func:`exact_rate`), or None (each clip's own)."""
        return None if self.frame_rate is None else exact_rate(self.frame_rate)

    @property
    def video(self) -> bool:
        """Clips train at more than one frame."""
        return max(self.frame_counts) > 1

    def batch_rows(self, processes: int = 1) -> tuple[int, int]:
        """``(images per process, images over all processes)`` of each micro-batch on ``processes``
        processes: ``batch_size`` per process, or ``global_batch_size`` split evenly.

        Raises:
            ConfigError: ``global_batch_size`` is not a multiple of ``processes``.
        """
        if self.global_batch_size is None:
            return self.batch_size, self.batch_size * processes
        if self.global_batch_size % processes:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is invalid with fsdp or ddp on {processes} "
                              f"processes: allowed a multiple of {processes} (each process trains an equal part), "
                              "or batch_size (per process) instead")
        return self.global_batch_size // processes, self.global_batch_size
