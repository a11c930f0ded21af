"""A warm process that forks ``segckpt`` commands: the imports are paid once, and each command
runs in a child process of its own (its own exit status, log, file-size limit, locks), as a user's
separate ``segckpt`` processes would. Shared by the tests that kill, starve or race trainers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = r"""
import json, os, resource, signal, sys
import torch
torch.set_num_threads(1)
from segmented_checkpointing import cli
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "run":
        pid = os.fork()
        if pid == 0:
            log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            if command.get("fsize") is not None:  # a disk that fills: writes past it fail with EFBIG
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (command["fsize"], command["fsize"]))
            os._exit(cli.main(command["argv"]))
        print(pid, flush=True)
    else:
        _, status = os.waitpid(command["pid"], 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
"""


class CliServer:
    """``start(argv, log)`` forks ``segckpt argv`` with its output in ``log`` and returns the pid;
    ``wait(pid)`` returns its exit status (negative: killed by that signal); ``run`` does both."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _ask(self, **command) -> int:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def start(self, argv: list[str], log: Path, fsize: int | None = None) -> int:
        """Fork ``segckpt argv``; ``fsize``: the largest file it may write, bytes (``RLIMIT_FSIZE``)."""
        return self._ask(op="run", argv=argv, log=str(log), fsize=fsize)

    def wait(self, pid: int) -> int:
        return self._ask(op="wait", pid=pid)

    def run(self, argv: list[str], log: Path, fsize: int | None = None) -> tuple[int, str]:
        """``(exit status, output)`` of ``segckpt argv`` run to its end."""
        status = self.wait(self.start(argv, log, fsize))
        return status, log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
