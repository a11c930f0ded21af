"""Atomic file writes: a temporary file in the destination folder, fsync, then ``os.replace``.

A crash or an interrupted run never leaves a half-written LoRA, state or report behind: readers
see either the old file or the new one. A process killed while writing can leave its temporary
file (``.<name>.<random>.tmp``) behind; :func:`remove_stale_temporaries` clears them when a run
starts in that folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import save_file


def _atomic(path: str | Path, write: Callable[[str], None]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_save_file(tensors: Mapping[str, torch.Tensor], path: str | Path,
                     metadata: Mapping[str, str] | None = None) -> Path:
    """Write a ``.safetensors`` file atomically; ``metadata`` goes to its header (str -> str)."""
    return _atomic(path, lambda tmp: save_file(dict(tensors), tmp, metadata=dict(metadata or {})))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write a UTF-8 text file atomically."""
    return _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write a binary file (e.g. a PNG) atomically."""
    return _atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete the temporary files that writers killed mid-write left in ``folder``; their count."""
    folder = Path(folder)
    stale = [p for p in folder.glob(".*.tmp") if p.is_file()] if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)
