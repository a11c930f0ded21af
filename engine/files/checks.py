"""Checks of the files the engine reads, before anything is built from them.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header naming every
tensor's dtype, shape and byte range, then the data (the format's specification,
huggingface/safetensors README). :func:`check_safetensors` reads the header alone and checks
that the file holds every byte it describes, so a truncated or empty file is named with what is
wrong before a model is loaded, instead of failing later in a loader with a traceback.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
"""The first four bytes of a GGUF file (the magic of the format's specification, in the ggml repository)."""
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class DamagedFileError(ValueError):
    """A file the engine reads is missing, truncated or not what it should be; the message names
    the file, what is wrong and what to do."""


def check_safetensors(path: str | Path, what: str, advice: str = "") -> dict[str, str]:
    """The header metadata of a complete ``.safetensors`` file (tensors are not read).

    Args:
        path: the file.
        what: what the file is, for the message (``the training state``, ``the LoRA``, ...).
        advice: what to do about a damaged one.

    Raises:
        DamagedFileError: missing, not a safetensors file (a text file, a pickle, an image), shorter
            than its header says, or an unreadable header.
    """
    metadata: Any = safetensors_header(path, what, advice).get("__metadata__") or {}
    return dict(metadata)


def safetensors_header(path: str | Path, what: str, advice: str = "") -> dict[str, Any]:
    """The whole JSON header of a complete ``.safetensors`` file: ``{tensor name: {"dtype",
    "shape", "data_offsets"}, "__metadata__": {...}}`` (tensors are not read).

    Raises:
        DamagedFileError: see :func:`check_safetensors`.
    """
    path = Path(path)
    tail = f"; {advice}" if advice else ""
    if not path.is_file():
        raise DamagedFileError(f"{what} {str(path)!r} does not exist{tail}")
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise DamagedFileError(f"{what} {str(path)!r} is damaged: {size} bytes, not a safetensors file{tail}")
            (length,) = struct.unpack("<Q", head)
            first = fh.read(1)
            if first and first != b"{":  # the header is a JSON object: anything else is another kind of file
                raise DamagedFileError(f"{what} {str(path)!r} is not a safetensors file: it begins with "
                                       f"{(head + first)[:9]!r}{_kind(head + first)}{tail}")
            if length > size - 8:
                raise DamagedFileError(f"{what} {str(path)!r} is damaged: truncated inside its header "
                                       f"({size} bytes){tail}")
            header = json.loads(first + fh.read(length - 1))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, DamagedFileError):
            raise
        raise DamagedFileError(f"{what} {str(path)!r} is damaged: its header cannot be read ({exc}){tail}") from exc
    if not isinstance(header, dict):
        raise DamagedFileError(f"{what} {str(path)!r} is damaged: its header is not a JSON object{tail}")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = entry["data_offsets"]
            nbytes = math.prod(entry["shape"]) * _DTYPE_BYTES.get(entry["dtype"], 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise DamagedFileError(f"{what} {str(path)!r} is damaged: tensor {name!r} is not described "
                                   f"properly ({exc}){tail}") from exc
        if stop - start != nbytes and entry["dtype"] in _DTYPE_BYTES:
            raise DamagedFileError(f"{what} {str(path)!r} is damaged: tensor {name!r} spans {stop - start} bytes "
                                   f"for {nbytes}{tail}")
        end = max(end, stop)
    if 8 + length + end != size:
        raise DamagedFileError(f"{what} {str(path)!r} is damaged: it holds {size} bytes where its header "
                               f"describes {8 + length + end} (truncated or overwritten){tail}")
    return header


def same_safetensors(a: str | Path, b: str | Path) -> bool:
    """Whether two complete ``.safetensors`` files hold the same tensors and metadata: their
    headers equal as JSON data (the order of the metadata's keys aside) and their tensor bytes
    equal byte for byte.

    Raises:
        DamagedFileError: a file is missing or damaged (see :func:`check_safetensors`).
    """
    header_a, header_b = safetensors_header(a, "file"), safetensors_header(b, "file")
    if header_a != header_b:
        return False
    with Path(a).open("rb") as fa, Path(b).open("rb") as fb:
        for fh in (fa, fb):
            fh.seek(8 + struct.unpack("<Q", fh.read(8))[0])
        while True:
            chunk = fa.read(1 << 20)
            if chunk != fb.read(1 << 20):
                return False
            if not chunk:
                return True


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name, or a file that begins with :data:`GGUF_MAGIC`."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _kind(start: bytes) -> str:
    """What a file that begins with ``start`` looks like: `` (a text file)``, `` (a pickle ...)``."""
    if start.startswith(b"PK\x03\x04") or start.startswith(b"\x80"):
        return " (a pickle or zip checkpoint: convert it to safetensors)"
    if start.startswith((b"\x89PNG", b"\xff\xd8", b"GIF8", b"RIFF")):
        return " (an image)"
    if start.startswith(GGUF_MAGIC):
        return " (a GGUF file)"
    try:
        start.decode("utf-8")
    except UnicodeDecodeError:
        return ""
    return " (a text file)"
