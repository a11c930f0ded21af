"""The sweep and the planner treat save_attention (and compile_blocks) as dimensions: the sweep's
-save-attn columns, and a lever the planner keeps only when it measures faster within the budget."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.measure.planner import PlanChoice, predict, write_choice
from segmented_checkpointing.engine.measure.planning import try_levers
from segmented_checkpointing.engine.measure.probe import BlockCost, Probe, probe
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.measure.sweep import sweep_schedules
from segmented_checkpointing.engine.model.bundle import build_preset


def test_the_sweep_adds_a_saved_attention_column_per_checkpointed_torch_and_unsloth_mode(tmp_path, capsys):
    added = [s.mode for s in sweep_schedules(False, save_attention=True)][13:]
    assert added == [f"{base}-{b}save-attn" for base in ("layer", "interval2", "interval2-stride4")
                     for b in ("", "unsloth-")]
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "--resolution", "32", "--warmup", "1", "--measure", "1", "--no-attention-offload",
                     "--save-attention", "--rank", "4", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| layer-save-attn | torch | no |" in printed and "| interval2-stride4-unsloth-save-attn | unsloth |" in printed
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    assert len(cells) == 13 + 6 and all(c["status"] == "ok" for c in cells)


def test_the_planner_keeps_a_lever_only_when_it_measures_faster_and_says_why(tmp_path):
    config = TrainConfig.create(resolution=32, lora=LoraSettings(rank=2, alpha=2.0), output=str(tmp_path))
    bundle = build_preset("flux")
    with RunWorkspace(config, bundle) as workspace:
        measured = probe(workspace, 1)
        chosen = predict(measured, CheckpointSchedule())
        choice = PlanChoice(2**40, chosen, [chosen], measured, measured_sec_per_step=1e-9, measured_peak_bytes=1)
        try_levers(choice, workspace, 1, 1, ("save_attention",))  # nothing beats 1 ns: not kept, with figures
        assert choice.chosen.schedule.mode == "layer" and not choice.compile_blocks
        (note,) = choice.notes
        assert note.startswith("gradient_checkpointing_save_attention: not kept (") and "x sec/step, peak" in note
        choice = PlanChoice(2**40, chosen, [chosen], measured, measured_sec_per_step=1e9, measured_peak_bytes=1)
        try_levers(choice, workspace, 1, 1, ("save_attention",))  # anything beats 1e9 s: kept
        assert choice.chosen.schedule.mode == "layer-save-attn" and choice.notes[0].startswith(
            "gradient_checkpointing_save_attention: kept (")
        choice = PlanChoice(1, chosen, [chosen], measured, measured_sec_per_step=1e9, measured_peak_bytes=1)
        try_levers(choice, workspace, 1, 1, ("save_attention",))  # faster but over a 1-byte budget
        assert "over the budget" in choice.notes[0] and choice.chosen.schedule.mode == "layer"


def test_segckpt_plan_says_which_levers_it_tried(tmp_path, capsys):
    assert cli.main(["plan", "--resolution", "32", "--budget", "device", "--measure", "1", "--rank", "2",
                     "--levers", "save_attention", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gradient_checkpointing_save_attention: not tried (none has no whole-block region" in out


def test_a_plan_that_keeps_compile_trains_compiled(tmp_path, monkeypatch, capsys):
    """Issue 37: a plan is a set of option changes. The compile lever measured faster is kept, written
    to schedule.json beside the schedule's keys, and ``segckpt train --config schedule.json`` compiles
    its blocks (``nn.Module.compile`` recorded, not run: inductor is slow on the CPU)."""
    runs = []

    class Faster:  # a workspace whose every lever run measures twice as fast within the budget
        def expect(self, steps):
            pass

        def run(self, schedule, warmup_steps, measured_steps, **changes):
            runs.append(changes)
            return SimpleNamespace(report={"totals": {"sec_per_step": 0.5}},
                                   history=[{"peak_bytes": 1000}] * (warmup_steps + measured_steps))

    costs = {name: [BlockCost(name, i, act=100) for i in range(2)] for name in ("double", "single")}
    measured = Probe("flux", "cpu", costs, peak_bytes=10_000, sec_per_step=1.0, offload_s_per_tensor=0.0,
                     offload_s_per_byte=0.0)
    chosen = predict(measured, CheckpointSchedule())
    choice = PlanChoice(2**40, chosen, [chosen], measured, measured_sec_per_step=1.0, measured_peak_bytes=1000)
    try_levers(choice, Faster(), 1, 1, ("compile",))
    assert runs == [{"compile_blocks": True}] and choice.compile_blocks is True
    assert choice.notes == ["compile_blocks: kept (0.500x sec/step, peak 9.313e-07 GiB, within the budget)"]
    path = write_choice(choice, tmp_path / "plan")["schedule"]
    assert json.loads(path.read_text()) == {**CheckpointSchedule().to_dict(), "compile_blocks": True}

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, *args, **kwargs: compiled.append(module))
    out = tmp_path / "train"
    assert cli.main(["train", "--config", str(path), "--steps", "1", "--resolution", "32", "--rank", "2",
                     "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["compile_blocks"] is True and report["plan"]["mode"] == "layer"
    assert report["compile"]["compiled_blocks"] == {"double": 8, "single": 8}  # flux's tiny preset: every block
    assert len(compiled) == 16  # each block compiled once
    assert {type(m).__name__ for m in compiled} == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
