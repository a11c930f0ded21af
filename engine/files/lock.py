"""One run per output folder: an operating-system lock on ``<folder>/.segckpt.lock``.

Two runs started together into one folder would both find it empty and both write there, one
result silently replacing the other. :class:`FolderLock` takes an exclusive, non-blocking lock
on a file in the folder for as long as the run lives (``fcntl.flock`` on POSIX, ``msvcrt.locking``
on Windows). The operating system releases it when the process ends in any way (a crash, a
kill, power off on a local disk), so a lock file left by a dead process is never "stale": the
next run takes it, and says so when the file names a process that is gone. The file holds the
holder's process id, host and start time, which the refused run names (with the holder's command
line where ``/proc`` shows it). Locks are per open file, so two runs in one process (a ComfyUI
server queueing two graphs into one run name) exclude each other too. :func:`check_free` asks
without taking the lock or writing anything, so a run refuses a held folder before its other
checks (a ``--resume`` into a folder a live run holds is answered with the holder, not with what
that run has not saved yet).
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
BUSY_RETRIES = 20
"""Tries, :data:`BUSY_WAIT` seconds apart, while the lock is held by no process its file names: a
run that took the lock an instant ago writes its record at once, and :func:`check_free` holds it
for an instant without writing one, so only a holder named in the file is refused at once."""
BUSY_WAIT = 0.05


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


def _command_line(pid: int) -> str | None:
    """The command line of process ``pid`` of this host as ``/proc`` shows it (Linux; on one line, at
    most 300 characters), else None."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    line = " ".join(" ".join(w.decode(errors="replace") for w in words).split())  # one line: a `-c` script has many
    return line[:300] + " ..." if len(line) > 300 else line or None


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another run (its process id was not written yet)"
    here = holder.get("host") in (None, socket.gethostname())
    mine = holder["pid"] == os.getpid() and here
    who = "another run in this process" if mine else f"process {holder['pid']}"
    if not here:
        who += f" on host {holder['host']}"
    since = holder.get("started")
    details = [f"running {holder.get('command', 'a run')} since {since}"] if since else []
    line = _command_line(int(holder["pid"])) if here and not mine else None
    if line:
        details.append(f"command line: {line}")
    return who + (f" ({'; '.join(details)})" if details else "")


def _held(fd: int, path: Path) -> dict | None:
    """None after taking the lock on ``fd``; else the record of the run holding it, retried while
    the file names no live holder yet (:data:`BUSY_RETRIES`)."""
    for attempt in range(BUSY_RETRIES):
        if _try_lock(fd):
            return None
        holder = _read_holder(path)
        if holder.get("pid") and (holder.get("host") != socket.gethostname() or _alive(int(holder["pid"]))):
            return holder
        if attempt + 1 < BUSY_RETRIES:
            time.sleep(BUSY_WAIT)
    return holder


def _in_use(folder: Path, holder: dict) -> FolderInUseError:
    return FolderInUseError(f"output={str(folder)!r} is in use by {_describe(holder)}: one run per output folder; "
                            "wait for it to end or choose another --output")


def check_free(folder: str | Path) -> None:
    """Refuse ``folder`` when a live run holds its lock; takes nothing and writes nothing (a
    folder or lock file that does not exist is free).

    Raises:
        FolderInUseError: naming the folder and the holder (process id, what it runs, since
            when, and its command line where ``/proc`` shows it).
    """
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # missing, or unreadable: the run's own lock names what is wrong
        return
    try:
        holder = _held(fd, path)
    finally:
        os.close(fd)  # releases the lock when this took it
    if holder is not None:
        raise _in_use(Path(folder), holder)


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
        holder = _held(fd, self.path)
        if holder is not None:
            os.close(fd)
            raise _in_use(self.folder, holder)
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
