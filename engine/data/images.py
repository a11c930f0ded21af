"""Images as a viewer shows them, cropped and scaled for the VAE.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .folder import DatasetError

BACKGROUND = (255, 255, 255)
"""Transparent pixels are composited onto white, as kohya's sd-scripts and SimpleTuner do."""
_INTEGER_RANGE = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535}


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as an image viewer shows ``image``.

    Transparency (an alpha channel, a palette or ``tRNS`` transparent colour) is composited onto
    :data:`BACKGROUND`; 16-bit grey is scaled by its format's range (65535), 32-bit integer grey
    by 2**31 - 1 (a PNG's by 65535: PNG stores at most 16 bits), float grey by 1.0, never by the
    image's own maximum; every other mode converts through Pillow (CMYK, YCbCr, bilevel, ...).
    """
    if image.mode in _INTEGER_RANGE or image.mode in ("I", "F"):
        top = _INTEGER_RANGE.get(image.mode) or (1.0 if image.mode == "F" else
                                                 65535 if image.format == "PNG" else 2**31 - 1)
        array = np.asarray(image, dtype=np.float64) / top * 255.0
        image = Image.fromarray(np.clip(np.round(array), 0, 255).astype(np.uint8), "L")
    if image.has_transparency_data:
        background = Image.new("RGBA", image.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def load_image(path: Path, size: int | tuple[int, int]) -> torch.Tensor:
    """Read (as a viewer shows it), resize to cover and centre-crop an image: ``(3, H, W)`` float in [-1, 1].

    Args:
        path: the image file.
        size: a square side ``R`` in pixels, or a bucket's ``(width, height)`` in pixels.

    Raises:
        DatasetError: the file cannot be read as an image (the message names the file).
    """
    width, height = (size, size) if isinstance(size, int) else size
    try:
        with Image.open(path) as image:
            image = to_rgb(ImageOps.exif_transpose(image))
            image = ImageOps.fit(image, (width, height), method=Image.Resampling.LANCZOS)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"image {str(path)!r} could not be read: {exc}") from exc
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


_TRANSPOSING = (5, 6, 7, 8)
"""EXIF orientations that swap width and height (transpose, rotate 90/270, transverse)."""


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` in pixels as a viewer shows the image (EXIF orientation applied); reads
    the header only.

    Raises:
        DatasetError: the file cannot be read as an image (the message names the file).
    """
    return _size(str(path), whole=False)


def check_image(path: Path) -> tuple[int, int]:
    """:func:`image_size` after Pillow read the whole file: a PNG's chunks and their checksums
    through ``verify()`` (nothing decompressed), other formats decoded (JPEG at 1/8 scale through
    ``draft``, which still reads every byte). Cached per file version (path, size, mtime), so the
    runs of a sweep check a folder once.

    Raises:
        DatasetError: not an image, truncated or damaged (the message names the file).
    """
    stat = path.stat()
    return _checked(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _checked(path: str, nbytes: int, mtime_ns: int) -> tuple[int, int]:
    return _size(path, whole=True)


def _size(path: str, whole: bool) -> tuple[int, int]:
    try:
        if whole:
            with Image.open(path) as image:
                if image.format == "PNG":
                    image.verify()  # must come first: reading the EXIF of a PNG loads it
                else:
                    image.draft(image.mode, (1, 1))  # JPEG: scale 1/8, the same mode
                    image.load()
        with Image.open(path) as image:
            width, height = image.size
            if image.getexif().get(0x0112) in _TRANSPOSING:  # 0x0112: the EXIF Orientation tag
                width, height = height, width
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DatasetError(f"image {path!r} could not be read: {exc}") from exc
    return width, height
