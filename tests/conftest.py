"""Test-session settings.

The tests run tiny models whose ops take microseconds: one intra-op thread is faster than two
and, on a loaded 2-core machine, avoids OpenMP threads spinning against each other (measured:
a tiny Flux step took 6-9 s with 2 threads under load, well under 1 s with 1).

The tests live in one folder per engine layer (``tests/core/``, ``tests/train/``, ...) plus
``nodes/``, ``cli/`` and ``live/``; the helpers they share (``helpers.py``, ``original_layouts.py``,
``comfy_models.py``) stay here, importable from every folder.
"""

import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list) -> None:
    """The modules marked ``heavy`` (a test of 20 s or more: the torchrun jobs, the killed trainer,
    the 50-run soak, the GPU check's smoke, per-block compile) run first, in collection order, the
    rest after them: with pytest-xdist a long test started near the end of the run would leave the
    other worker idle until it ends (longest processing time first, the classic schedule for parallel
    machines)."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True, scope="session")
def short_calibration():
    """The planner's calibration times 2 steps per run after its warm-up here, not 5
    (``engine/measure/costs.py`` CALIBRATION_STEPS): the tests check what the planner does with the
    rates it measures (its counts, choices, peaks and progress), never how well they predict time,
    which ``bench/planner_accuracy.py`` measures. About 20 probes calibrate in a run of the suite,
    each 1.5-7.5 s at 5 steps. Subprocesses (the CLI in its own process, torchrun) keep the default."""
    from segmented_checkpointing.engine.measure import costs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costs, "CALIBRATION_STEPS", 2)
        yield


@pytest.fixture
def offline(monkeypatch):
    """No network: every socket connection fails, and the hub is told it is offline (the
    single-file tests: nothing may download)."""
    def refuse(*_args, **_kw):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
