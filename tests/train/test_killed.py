"""A training process killed (SIGKILL) at 20 random moments, during steps and during saves: every
time the files on disk load, and resuming reaches the same final LoRA as an uninterrupted run.

The runs are forked from one warm server process (``tests/cli_server.py``: imports done once),
so each kill costs a run's set-up and a step or two, not an interpreter start."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from cli_server import CliServer
from safetensors.torch import load_file

from segmented_checkpointing.engine.train.state import load_state

pytestmark = pytest.mark.heavy
KILLS = 20
STEPS = 2 * KILLS + 1  # each attempt advances the saved state by at most 2 steps (see below): the last kill lands in the run


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
    s = CliServer()
    yield s
    s.close()


def test_killed_at_random_moments_resumes_to_the_uninterrupted_lora(server, tmp_path):
    reference = tmp_path / "reference"
    pid = server.start(_argv(reference), tmp_path / "reference.log")
    assert server.wait(pid) == 0, (tmp_path / "reference.log").read_text()[-2000:]

    # the shortest step of the reference run, seconds: a kill waits for 0 or 1 steps of its attempt, then up
    # to one such step more (into the next step, or into the save after one), so whatever the machine's speed
    # an attempt saves at most 2 steps, and the kills land all over the run, not after its end
    step_s = min(float(line.split(" s/step")[0].split()[-1])
                 for line in (tmp_path / "reference.log").read_text().splitlines() if " s/step " in line)
    out, rng, killed_at = tmp_path / "killed", random.Random(20261130), []
    for attempt in range(KILLS):
        resume = ["--resume"] if (out / "training_state.safetensors").exists() else []
        log = tmp_path / f"attempt{attempt}.log"
        pid = server.start(_argv(out, *resume), log)
        _wait_for_steps(log, rng.randint(0, 1), pid)
        time.sleep(rng.uniform(0.0, step_s))
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
