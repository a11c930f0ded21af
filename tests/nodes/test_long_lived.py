"""A long-lived process stays flat: 50 in-process runs of the demo workflow (2 steps each) keep
resident memory, open files and threads level, and release every host pool, interrupted runs too.
This is what a ComfyUI server that trains all day needs."""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import os
from pathlib import Path

import pytest

from segmented_checkpointing.engine.api import TrainResult
from segmented_checkpointing.engine.core.offload import HostPool
from segmented_checkpointing.nodes import environment, training_nodes
from segmented_checkpointing.nodes.graph import run_graph

pytestmark = pytest.mark.heavy
API = Path(__file__).resolve().parents[2] / "workflows" / "api"
MIB = 1 << 20


def _resident_bytes() -> int:
    """Resident bytes of live memory: glibc first returns the freed pages it still holds
    (``malloc_trim``), so what earlier tests of this worker freed does not read as growth."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: read the resident size as it is
        pass
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pools() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is HostPool)


def _graph(name: str, run_name: str) -> dict:
    graph = json.loads((API / name).read_text())
    graph = copy.deepcopy(graph)
    for node in graph.values():
        if node["class_type"] == "SegCkptTrainLoRA":
            node["inputs"].update(steps=2, run_name=run_name)
        if node["class_type"] == "SegCkptImageCaptionDataset":
            node["inputs"].update(resolution=32)  # the graph as shipped, on smaller images (CI time)
    return graph


def test_fifty_runs_of_the_demo_workflow_stay_flat(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    for i in range(50):
        run_graph(_graph("train_segmented_lora.api.json", f"run{i}"))
        if i + 1 == 5:
            gc.collect()
            rss, files, threads = _resident_bytes(), _open_files(), _threads()
    gc.collect()
    grown = _resident_bytes() - rss
    assert grown <= max(0.05 * rss, 50 * MIB), f"resident memory grew {grown / MIB:.1f} MiB over 45 runs"
    assert _open_files() == files and _threads() == threads

    # offloading runs, one of them interrupted after its first step, release their host pools
    run_graph(_graph("train_with_offload.api.json", "offload"))
    local = environment.local_host(tmp_path)
    polls = iter(range(100))
    interrupted = environment.Host(local.input_dir, local.diffusers_dirs, local.loras_dir, local.output_dir,
                                   local.progress, lambda: next(polls) >= 0, local.send)
    monkeypatch.setattr(training_nodes, "current_host", lambda: interrupted)
    results = run_graph(_graph("train_with_offload.api.json", "offload-interrupted"))
    run = next(v.result for v in results.values() if isinstance(v.result[0], TrainResult))
    assert run[0].interrupted and len(run[0].history) == 1
    assert _pools() == 0 and _open_files() == files and _threads() == threads
