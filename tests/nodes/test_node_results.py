"""What Train LoRA, Save LoRA and Run Report tell the user when a run does less than asked: a
resume with nothing left, an offload backend over a schedule that checkpoints nothing, a Cancel."""

from __future__ import annotations

import dataclasses
import json

import pytest

from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes import training_nodes
from segmented_checkpointing.nodes.environment import local_host
from segmented_checkpointing.nodes.graph import run_node

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TRAIN = {"learning_rate": 1e-3, "lr_scheduler": "constant", "batch_size": 1, "gradient_accumulation_steps": 1,
         "seed": 0}


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The local host under ``tmp_path``, recording the page events (``host.sent``)."""
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    sent = []
    made = dataclasses.replace(local_host(tmp_path), send=lambda event, data: sent.append((event, data)))
    made.sent = sent
    monkeypatch.setattr(training_nodes, "current_host", lambda: made)
    return made


def _inputs(**schedule):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0)
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("(built-in sample photos)", 64)
    keys = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
            "gradient_checkpointing_interval": 0, "gradient_checkpointing_segment_stride": 0,
            "gradient_checkpointing_offload_attention": False,
            "gradient_checkpointing_offload_pin_memory_max_buckets": 12, **schedule}
    (planned,) = NODES["SegCkptSchedule"].execute(family="flux", **keys)
    return model, planned, dataset


def _notes(host) -> list[str]:
    sent = [data["lines"] for event, data in host.sent if event == "segckpt.notes"]
    return sent[-1] if sent else []


def test_a_resume_with_nothing_left_says_0_steps_and_keeps_the_lora(host, tmp_path):
    model, schedule, dataset = _inputs()
    train, save = NODES["SegCkptTrainLoRA"], NODES["SegCkptSaveLoRA"]
    (first,) = run_node(train, model, schedule, dataset=dataset, steps=2, run_name="again", resume=False, **TRAIN)
    assert save.execute(first, "again").result == ("again_00001.safetensors",)
    lora = tmp_path / "output" / "segckpt" / "again_00001" / "lora.safetensors"
    written = lora.stat().st_mtime_ns, lora.read_bytes()

    (second,) = run_node(train, model, schedule, dataset=dataset, steps=2, run_name="again", resume=True, **TRAIN)
    assert second.trained_steps == 0 and second.resumed_at == 2 and len(second.history) == 2
    assert (lora.stat().st_mtime_ns, lora.read_bytes()) == written  # not rewritten
    totals = json.loads((lora.parent / "report.json").read_text())["totals"]
    assert (totals["steps"], totals["trained_steps"], totals["resumed_at_step"]) == (2, 0, 2)
    assert _notes(host)[-1] == "0 steps trained: the run already had 2 of 2 steps (raise steps to continue it)"
    report = NODES["SegCkptRunReport"].execute(second).ui["text"][0]
    assert report.splitlines()[0] == ("2 steps (0 trained in this run: it resumed at step 2 of 2, nothing left; raise "
                                      "steps to continue it; the LoRA is unchanged), final loss "
                                      f"{second.history[-1]['loss']:.4f}")
    saved = save.execute(second, "again")
    assert saved.result == ("again_00001.safetensors",)  # the earlier file holds this LoRA
    assert saved.ui["text"][0].startswith("unchanged: models/loras/again_00001.safetensors (2 steps, rank 16")
    assert "this run trained 0 steps (it resumed at step 2 of 2: nothing left)" in saved.ui["text"][0]
    assert sorted(p.name for p in (tmp_path / "models" / "loras").iterdir()) == ["again_00001.safetensors"]

    (third,) = run_node(train, model, schedule, dataset=dataset, steps=3, run_name="again", resume=True, **TRAIN)
    assert third.trained_steps == 1 and lora.read_bytes() != written[1]
    report = NODES["SegCkptRunReport"].execute(third).ui["text"][0]
    assert report.startswith("3 steps (1 trained in this run, resumed at step 2), final loss")
    assert save.execute(third, "again").result == ("again_00002.safetensors",)


def test_an_offload_backend_over_a_schedule_without_checkpointing_says_it_does_nothing(host):
    model, schedule, dataset = _inputs(gradient_checkpointing=False)  # as the planner's `none`
    (offload,) = NODES["SegCkptOffloadOptions"].execute(gradient_checkpointing_backend="unsloth",
                                                       gradient_checkpointing_offload_attention=False,
                                                       gradient_checkpointing_offload_pin_memory_max_buckets=12)
    (run,) = run_node(NODES["SegCkptTrainLoRA"], model, schedule, dataset=dataset, offload=offload, steps=1,
                      run_name="moot", resume=False, **TRAIN)
    note = ("gradient_checkpointing=False: gradient_checkpointing_backend=unsloth does nothing (no block is "
            "checkpointed, so no checkpointed region's inputs are offloaded or recomputed)")
    assert _notes(host)[0] == f"Activation Offload Options: {note}"
    assert f"note: {note}" in NODES["SegCkptRunReport"].execute(run).ui["text"][0]


def test_cancel_names_the_nodes_resume_not_the_command_lines(host, monkeypatch, capsys):
    model, schedule, dataset = _inputs()
    monkeypatch.setattr(host, "interrupted", lambda: True)  # Cancel during step 1
    (run,) = run_node(NODES["SegCkptTrainLoRA"], model, schedule, dataset=dataset, steps=3, run_name="cancelled",
                      resume=False, **TRAIN)
    assert run.interrupted and len(run.history) == 1
    log = capsys.readouterr().out
    assert "interrupted after step 1: state saved, resume with resume=true" in log and "--resume" not in log
    assert _notes(host)[-1] == ("cancelled after step 1 of 3: the state is saved; queue again with resume on "
                                "(same run_name) to continue")
