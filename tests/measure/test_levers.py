"""The sweep and the planner treat save_attention (and compile_blocks) as dimensions: the sweep's
-save-attn columns, and a lever the planner keeps only when it measures faster within the budget."""

from __future__ import annotations

import json

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.measure.levers import try_levers
from segmented_checkpointing.engine.measure.planner import PlanChoice, predict
from segmented_checkpointing.engine.measure.probe import probe
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
        measured = probe(config, bundle, 1, workspace=workspace)
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
