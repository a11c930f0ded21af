"""The training data of a run: the image folder, the size images are cropped to, the buckets and
the batch (read by ``engine/data/``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import check_options, option

MAX_RESOLUTION = 8192


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how they are batched. Validated at construction.

    Raises:
        ConfigError: a field is out of range, or ``resolution`` is not a multiple of 16.
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
    batch_size: int = option(1, "Images per micro-batch.", "--batch-size", min=1, max=1024)

    def __post_init__(self) -> None:
        check_options(self)
