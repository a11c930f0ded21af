"""The ``segckpt`` process around a command (``cli.py``): Ctrl-C and SIGTERM, the CPU threads of
torch's operations, and how warnings and errors print. The engine does none of this (it starts no
threads, sets no thread count and installs no signal handler: a ComfyUI server's are its own)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings

from .engine import api

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Where a user sets the CPU threads of torch's operations (torch reads them when it starts)."""


def cpu_threads(config: api.TrainConfig, log=print) -> int | None:
    """Choose the CPU threads of torch's operations for a CPU run whose user set none (neither of
    :data:`THREAD_VARIABLES`): every usable core but one (``api.usable_cores``), at least 1, at
    most torch's default; said in one line. Each operation's threads wait for the slowest, so one
    core taken by another process stalls them all (bench/README.md "CPU threads"). The engine
    sets no thread count (a ComfyUI server's are its own): this is the command line's choice.

    Returns:
        The threads chosen, or None (a CUDA run, or the user's own setting kept).
    """
    if any(os.environ.get(name) for name in THREAD_VARIABLES):
        return None
    with api.lazy_imports():
        import torch

    if config.model.device == "cuda" or config.model.device == "auto" and torch.cuda.is_available():
        return None
    default, cores = torch.get_num_threads(), api.usable_cores()
    threads = max(1, min(default, cores - 1))
    torch.set_num_threads(threads)
    log(f"cpu: {threads} thread{'s' if threads > 1 else ''} for torch's operations ({cores} usable cores, one left "
        f"for the rest; torch's default {default}); set OMP_NUM_THREADS to choose")
    return threads


def console_messages() -> None:
    """Our warnings print as one ``segckpt: warning:`` line; other libraries' keep their origin
    (a torch warning is not ours to claim)."""
    def one_line(message, category, filename, lineno, *_args, **_kw) -> str:
        if category.__module__.startswith(__package__ or "segmented_checkpointing"):
            return f"segckpt: warning: {message}\n"
        return f"warning ({category.__name__}, {filename}:{lineno}): {message}\n"

    warnings.formatwarning = one_line


class StopOnSignal:
    """Ctrl-C / SIGTERM end training cleanly after the current step (the state is saved); a
    second Ctrl-C interrupts at once."""

    def __init__(self):
        self.signal_name, self._old = None, {}

    def __call__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        rank = torchrun_rank()
        if rank is None:
            print(f"\n{self.signal_name}: stopping after this step (again to abort)", file=sys.stderr)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        elif rank == 0:  # torchrun passes a second Ctrl-C on as SIGTERM: every process stops at the same step
            print(f"\n{self.signal_name}: every process stops after this step and the state is saved", file=sys.stderr)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def torchrun_rank() -> int | None:
    """This process's rank when ``torchrun`` started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def error(exc: BaseException) -> int:
    """Print ``segckpt: error: ...`` (under torchrun from rank 0 only: the set-up checks are the same
    on every process) and return exit status 2."""
    if (torchrun_rank() or 0) == 0:
        print(f"segckpt: error: {exc}", file=sys.stderr)
    return 2
