"""One run per output folder: an operating-system lock on ``<folder>/.segckpt.lock``.

Two runs started together into one folder would both find it empty and both write there, one
result silently replacing the other. :class:`FolderLock` takes an exclusive, non-blocking lock
on a file in the folder for as long as the run lives (``fcntl.flock`` on POSIX, ``msvcrt.locking``
on Windows). The operating system releases it when the process ends in any way (a crash, a
kill, power off on a local disk), so a lock file left by a dead process is never "stale": the
next run takes it, and says so when the file names a process that is gone. The file holds the
holder's process id, host and start time, which the refused run names. Locks are per open file,
so two runs in one process (a ComfyUI server queueing two graphs into one run name) exclude
each other too.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path

from .atomic import OutputWriteError

if sys.platform == "win32":  # pragma: no cover (CI runs on Linux)
    import msvcrt
else:
    import fcntl

LOCK_FILE = ".segckpt.lock"


class FolderInUseError(ValueError):
    """Another run holds the output folder's lock; the message names the folder and the holder."""


def _try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; False when another holds it."""
    if sys.platform == "win32":  # pragma: no cover (CI runs on Linux)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another run (its process id was not written yet)"
    mine = holder["pid"] == os.getpid() and holder.get("host") == socket.gethostname()
    who = "another run in this process" if mine else f"process {holder['pid']}"
    if holder.get("host") and holder["host"] != socket.gethostname():
        who += f" on host {holder['host']}"
    since = holder.get("started")
    return who + (f" (running {holder.get('command', 'a run')} since {since})" if since else "")


class FolderLock:
    """The exclusive lock of one run on its output folder; :meth:`release` (or the process's
    end, or the object's collection) lets the next run in.

    Args:
        folder: the output folder (created when missing).
        command: what holds it, for the refusal's message (``segckpt train``, ``ComfyUI``).

    Attributes:
        took_over: the process id named by a lock file whose process is gone (None otherwise):
            a run killed earlier, whose lock the operating system released.

    Raises:
        FolderInUseError: another run holds it; the message names the folder and the holder.
        OutputWriteError: the folder or its lock file cannot be written.
    """

    def __init__(self, folder: str | Path, command: str = "a training run"):
        self.folder, self.path = Path(folder), Path(folder) / LOCK_FILE
        self.took_over: int | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputWriteError(f"output={str(self.folder)!r} is invalid: allowed a folder this process can "
                                   f"write ({exc.strerror or exc} for its lock file {LOCK_FILE})") from exc
        if not _try_lock(fd):
            os.close(fd)
            holder = _read_holder(self.path)
            raise FolderInUseError(f"output={str(self.folder)!r} is in use by {_describe(holder)}: one run per "
                                   "output folder; wait for it to end or choose another --output")
        before = _read_holder(self.path)
        if before.get("pid") and before.get("host") == socket.gethostname() and not _alive(int(before["pid"])):
            self.took_over = int(before["pid"])
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode())
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._finalizer.alive

    def release(self) -> None:
        """Let the next run in (idempotent). The lock file stays: removing it while another
        process waits on it would let two runs hold two different files."""
        if self._finalizer.alive:
            os.ftruncate(self._fd, 0)
            self._finalizer()  # closing the file releases the lock
