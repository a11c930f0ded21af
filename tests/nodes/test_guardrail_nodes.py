"""The guardrails through the nodes, in the shipped workflow (workflows/api/fit_guardrails.api.json):
buckets, the pre-flight verdict, an out-of-memory switch and a slowdown each appear on Train LoRA
(``segckpt.notes`` events) and in the Run Report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import verdict

from segmented_checkpointing.engine.train import recovery
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes import training_nodes
from segmented_checkpointing.nodes.environment import NodeError, local_host
from segmented_checkpointing.nodes.graph import run_graph

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "api" / "fit_guardrails.api.json"


@pytest.fixture
def events(tmp_path, monkeypatch):
    """The page events the nodes send, with the host's folders under ``tmp_path``."""
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    sent = []

    def progress(node, total):  # ComfyUI's bar: (value, max) after every update
        return lambda value, new_total=None: sent.append(("progress", (value, new_total or total)))

    host = dataclasses.replace(local_host(tmp_path), send=lambda event, data: sent.append((event, data)),
                               progress=progress)
    monkeypatch.setattr(training_nodes, "current_host", lambda: host)
    return sent


def _run(steps=4, buckets=True, **guardrails):
    graph = json.loads(WORKFLOW.read_text())
    graph["5"]["inputs"]["steps"] = steps
    graph["2"]["inputs"].update(resolution=64, buckets=buckets)
    graph["4"]["inputs"].update(guardrails)
    results = run_graph(graph)
    return results["5"][0], results["7"].result[0]


def _notes(events) -> list[str]:
    sent = [data["lines"] for event, data in events if event == "segckpt.notes"]
    return sent[-1] if sent else []


def test_the_verdict_buckets_and_receipt_show_on_the_node_and_in_the_report(events):
    result, report = _run()
    notes = _notes(events)
    assert notes[0].startswith("pre-flight: interval2-stride4 fits in")
    assert sum(line.lstrip().startswith("ok") for line in notes) == len(result.report["dataset"]["buckets"]) >= 2
    assert "pre-flight: interval2-stride4 fits" in report and "receipt: interval2-stride4" in report
    assert result.report["preflight"]["fits"] and len(result.report["dataset"]["buckets"]) >= 2


def test_the_pre_flight_moves_the_bar_and_says_its_phase_before_step_1(events):
    """The pre-flight runs before step 1 (minutes on a real model): the bar counts its probe steps
    to their end, the node's last line names the phase, then the bar counts the training steps."""
    from segmented_checkpointing.engine.measure.costs import forget_calibrations
    from segmented_checkpointing.engine.measure.probe import probe_steps

    forget_calibrations()  # none measured yet in this process (a later queue takes this one and probes fewer steps)
    _run(steps=3)
    probes = probe_steps(1) + probe_steps(1, calibrate=False)  # two buckets: the first calibrates
    bar = [data for event, data in events if event == "progress"]
    assert bar == [(0, 1), (0, probes)] + [(k, probes) for k in range(1, probes + 1)] + [(k, 3) for k in (1, 2, 3)]
    status = [data["lines"][-1] for event, data in events if event == "segckpt.notes"
              and data["lines"][-1].startswith(("pre-flight: probe", "pre-flight: encoding"))]
    assert status[0] == "pre-flight: encoding the data"
    assert status[1:] == [f"pre-flight: probe step {k}/{probes} (one probe per batch shape)" for k in range(probes + 1)]
    assert _notes(events)[0].startswith("pre-flight: interval2-stride4 fits in")  # the verdict replaces it


def test_an_out_of_memory_error_at_step_3_switches_and_shows(events, monkeypatch):
    real = recovery.train_step

    def failing(ctx, step):  # step 3 under the workflow's schedule runs out of memory
        if step == 2 and ctx.config.schedule.mode == "interval2-stride4":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(ctx, step)

    monkeypatch.setattr(recovery, "train_step", failing)
    result, report = _run(steps=5)
    line = "step 3: out of memory under interval2-stride4: switched to interval2-stride4-unsloth-ffn"
    assert line in _notes(events) and line in report
    assert result.config.schedule.mode == "interval2-stride4-unsloth-ffn" and len(result.history) == 5


def test_a_slowdown_from_step_8_shows(events, monkeypatch):
    real = recovery.train_step

    def slowed(ctx, step):  # the measured step time doubles from step 8 on
        record = real(ctx, step)
        record.timing.seconds = 0.1 * (2 if record.step >= 8 else 1)
        return record

    monkeypatch.setattr(recovery, "train_step", slowed)
    # one shape, as the engine's case (with buckets each shape first needs a baseline of its own)
    result, report = _run(steps=13, buckets=False, watchdog_slowdown=1.5)
    slow = [line for line in _notes(events) if line.startswith("slowdown")]
    assert len(slow) == 1 and slow[0].startswith("slowdown from step 8: 2.00x")
    assert "watchdog: slowdown from step 8" in report


def test_a_budget_too_small_stops_before_training_naming_a_schedule(events, tmp_path):
    with pytest.raises(NodeError) as info:
        _run(memory_budget="0.00001")
    text = str(info.value)
    assert "does NOT fit" in text and "not started" in text and str(tmp_path) not in text
    assert not list((tmp_path / "output" / "segckpt").glob("guarded_lora_*/lora.safetensors"))
    assert _notes(events)[0].startswith("pre-flight: interval2-stride4 does NOT fit")


@pytest.mark.parametrize("inputs, text", [
    ({"memory_budget": "lots", "watchdog_slowdown": 1.5}, "memory_budget='lots'"),
    ({"memory_budget": "free", "watchdog_slowdown": 0.5}, "watchdog_slowdown=0.5"),
])
def test_bad_guardrails_are_refused_at_validation(inputs, text):
    assert text in verdict(NODES["SegCkptFitGuardrails"], **inputs)


def test_the_planner_judges_its_choice_per_bucket(events, tmp_path, monkeypatch):
    from segmented_checkpointing.nodes import planning_nodes

    monkeypatch.setattr(planning_nodes, "current_host", training_nodes.current_host)  # the bar's updates
    graph = json.loads((WORKFLOW.parent / "plan_then_train.api.json").read_text())
    graph["2"]["inputs"].update(resolution=64, buckets=True)
    graph["3"]["inputs"].update(measured_steps=0, budget_gib=1.0)
    graph["4"]["inputs"]["steps"] = 2
    results = run_graph(graph)
    text = results["3"].ui["text"][0]
    assert "pre-flight:" in text and "fits in 1 GiB" in text
    assert text.count(" ok ") >= 2  # one line per bucket
    assert results["3"].result[0].schedule.mode in text
    # one bar for the probe, then the per-bucket check after it: it moves on and ends full
    bar = [data for event, data in events if event == "progress"][:-2]  # Train LoRA's own two steps follow
    values = [value for value, _ in bar]
    assert values[0] == 1 and all(b - a in (0, 1) for a, b in zip(values, values[1:])), bar
    assert bar[-1][0] == bar[-1][1] == len(set(values)) > 11, bar  # the probe's 11 steps, then the buckets' probes
