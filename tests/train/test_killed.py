"""A training process killed (SIGKILL) at 20 random moments, during steps and during saves: every
time the files on disk load, and resuming reaches the same final LoRA as an uninterrupted run.

The runs are forked from one warm server process (imports done once), so each kill costs a
run's set-up and a step or two, not an interpreter start."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from segmented_checkpointing.engine.train.state import load_state

ROOT = Path(__file__).resolve().parents[2]
SERVER = r"""
import json, os, sys
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
            os._exit(cli.main(command["argv"]))
        print(pid, flush=True)
    else:
        _, status = os.waitpid(command["pid"], 0)
        print(status, flush=True)
"""
STEPS = 30
KILLS = 20


class _Server:
    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _ask(self, **command) -> int:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def start(self, argv, log: Path) -> int:
        return self._ask(op="run", argv=argv, log=str(log))

    def wait(self, pid: int) -> int:
        return self._ask(op="wait", pid=pid)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _argv(out: Path, *extra: str) -> list[str]:
    return ["train", "--steps", str(STEPS), "--resolution", "32", "--save-every", "1", "--output", str(out), *extra]


def _wait_for_steps(log: Path, count: int, pid: int, timeout: float = 120.0) -> None:
    """Until the child's log shows ``count`` finished steps (or the child is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.count(" s/step ") >= count or "done:" in text:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"no {count} steps in {log}")


def _files_load(out: Path) -> None:
    """Whatever the killed run left on disk is complete."""
    if (out / "training_state.safetensors").exists():
        load_state(out)
    if (out / "lora.safetensors").exists():
        load_file(out / "lora.safetensors")
    if (out / "report.json").exists():
        json.loads((out / "report.json").read_text())


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_killed_at_random_moments_resumes_to_the_uninterrupted_lora(server, tmp_path):
    reference = tmp_path / "reference"
    pid = server.start(_argv(reference), tmp_path / "reference.log")
    assert server.wait(pid) == 0, (tmp_path / "reference.log").read_text()[-2000:]

    out, rng, killed_at = tmp_path / "killed", random.Random(20261130), []
    for attempt in range(KILLS):
        resume = ["--resume"] if (out / "training_state.safetensors").exists() else []
        log = tmp_path / f"attempt{attempt}.log"
        pid = server.start(_argv(out, *resume), log)
        _wait_for_steps(log, rng.randint(0, 2), pid)
        time.sleep(rng.uniform(0.0, 0.25))  # into the next step, or into the save after a step
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(pid)
        _files_load(out)
        killed_at.append(load_state(out).step if (out / "training_state.safetensors").exists() else 0)
    assert killed_at[-1] < STEPS, "the run finished before the last kill: raise STEPS"
    assert len(set(killed_at)) > 5  # the kills landed at many different points of the run

    pid = server.start(_argv(out, "--resume"), tmp_path / "final.log")
    assert server.wait(pid) == 0, (tmp_path / "final.log").read_text()[-2000:]
    final, expected = load_file(out / "lora.safetensors"), load_file(reference / "lora.safetensors")
    assert final.keys() == expected.keys()
    assert max((final[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
    assert json.loads((out / "report.json").read_text())["totals"]["steps"] == STEPS
