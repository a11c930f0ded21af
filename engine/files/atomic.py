"""Atomic file writes: a temporary file in the destination folder, fsync, then ``os.replace``.

A crash or an interrupted run never leaves a half-written LoRA, state or report behind: readers
see either the old file or the new one. A process killed while writing can leave its temporary
file (``.<name>.<random>.tmp``) behind; :func:`remove_stale_temporaries` clears them when a run
starts in that folder.

Every file a run writes (the LoRA, the state, ``report.json``, the latent cache, previews, plots,
sweep and plan tables) goes through :func:`atomic_write`, so a write that the file system refuses (no
permission, no space, file too large, read-only file system) ends in one
:class:`OutputWriteError` naming the file, with nothing replaced. :func:`check_writable` finds a
folder that cannot be written before any model is built. This module imports no heavy library, so
the refusals that look at the output folder answer before torch is imported (``.safetensors``
files are written by ``engine/files/tensors.py`` through :func:`atomic_write`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


class OutputWriteError(OSError, ValueError):
    """A file could not be written (no permission, no space, file too large, read-only file
    system). Its message is one line naming the file and the reason; the file that was there
    before, if any, is unchanged (the write went to a temporary file that is removed). A
    ``ValueError`` too, so every front end reports it in one line as it does a refusal."""


def _reason(exc: BaseException, path: Path | None = None) -> str:
    """What the file system said, without the traceback's noise: ``No space left on device``;
    a file standing where a folder of ``path`` should be is named as such."""
    blocker = next((p for p in (path.parents if path is not None else ()) if p.is_file()), None)
    if blocker is not None:
        return f"{str(blocker)!r} is a file, not a folder"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).strip() or type(exc).__name__  # SafetensorError: "... File too large (os error 27)"


def atomic_write(path: str | Path, write: Callable[[str], None],
                 errors: tuple[type[BaseException], ...] = (OSError,)) -> Path:
    """Write ``path`` atomically: ``write(temporary path)`` fills a temporary file in the same
    folder, which is fsynced and renamed over ``path``.

    Args:
        errors: what ``write`` raises when the file system refuses (besides ``OSError``, a
            library's own I/O error, e.g. safetensors' ``SafetensorError``).

    Raises:
        OutputWriteError: one of ``errors``, naming the file and the reason; nothing was replaced.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except errors as exc:
        raise OutputWriteError(f"cannot write {str(path)!r}: {_reason(exc, path)}; nothing there was replaced") from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def check_writable(folder: str | Path, key: str) -> None:
    """Check that files can be created in ``folder`` (or, when it does not exist yet, in the
    nearest folder above it that does), by creating and removing a temporary file there: a
    permission bit, an immutable folder (``chattr +i``), a read-only mount or a file standing
    where a folder should be all fail here, before any model is built (``os.access`` misses the
    last three and everything for root). Creates nothing that stays.

    Raises:
        OutputWriteError: naming ``key``, the folder and the reason.
    """
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(20, f"{str(probe)!r} is a file, not a folder")
        fd, tmp = tempfile.mkstemp(prefix=".segckpt-write-check.", suffix=".tmp", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise OutputWriteError(f"{key}={str(folder)!r} is invalid: allowed a folder this process can write "
                               f"({_reason(exc)} in {str(probe)!r})") from exc


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write a UTF-8 text file atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write a binary file (e.g. a PNG) atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete the temporary files that writers killed mid-write left in ``folder``; their count."""
    folder = Path(folder)
    stale = [p for p in folder.glob(".*.tmp") if p.is_file()] if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)
