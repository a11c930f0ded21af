"""The training data of a run: the image folder, the size images are cropped to, the buckets and
the batch (read by ``engine/data/``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import ConfigError, check_options, option

MAX_RESOLUTION = 8192
MAX_BATCH = 1024


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
    batch_size: int = option(1, "Images per micro-batch on each process (with fsdp on N processes the global batch "
                             "is batch_size x N, as SimpleTuner's train_batch_size, accelerate and kohya count it).",
                             "--batch-size", min=1, max=MAX_BATCH)
    global_batch_size: int | None = option(
        None, "Images per micro-batch over all processes, instead of batch_size: with fsdp on N processes each trains "
        "global_batch_size / N of them (a multiple of N); one process trains them all. Unset: batch_size per process.",
        "--global-batch-size", min=1, max=MAX_BATCH)

    def __post_init__(self) -> None:
        check_options(self)
        if self.global_batch_size is not None and self.batch_size != 1:
            raise ConfigError(f"global_batch_size={self.global_batch_size!r} is invalid with batch_size="
                              f"{self.batch_size!r}: allowed unset when batch_size is set (give one of them: "
                              "batch_size per process, or global_batch_size over all processes).")

    def batch_rows(self, processes: int = 1) -> tuple[int, int]:
        """``(images per process, images over all processes)`` of each micro-batch on ``processes``
        processes: ``batch_size`` per process, or ``global_batch_size`` split evenly.

        Raises:
            ConfigError: ``global_batch_size`` is not a multiple of ``processes``.
        """
        if self.global_batch_size is None:
            return self.batch_size, self.batch_size * processes
        if self.global_batch_size % processes:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is invalid with fsdp on {processes} "
                              f"processes: allowed a multiple of {processes} (each process trains an equal part), "
                              "or batch_size (per process) instead")
        return self.global_batch_size // processes, self.global_batch_size
