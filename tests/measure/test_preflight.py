"""The pre-flight verdict on the CPU tracker: with a budget between the small and the large bucket's
peak under the run's schedule, the large bucket is judged not to fit, a schedule that fits is
named, and a run with that schedule stays under the budget; the CLI (``plan --check``, ``train
--budget``) and the receipt."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.measure.planner import MARGIN
from segmented_checkpointing.engine.measure.preflight import preflight
from segmented_checkpointing.engine.measure.receipt import neighbours
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SCHEDULE = CheckpointSchedule(gradient_checkpointing=False)  # the run's own schedule: the largest peaks
# two buckets at resolution 64 (flux: 16 px multiples): square 64x64 (16 image tokens) and a wide
# 5:3 one of fewer pixels (80x48: 15 image tokens)
SIZES = [(64, 64)] * 3 + [(160, 96)] * 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preflight") / "data"
    folder.mkdir()
    for i, size in enumerate(SIZES):
        Image.new("RGB", size, (40 * i, 100, 200 - 30 * i)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"photo {i}")
    return folder


def _config(data_dir, **changes):
    return TrainConfig.create(**{"family": "flux", "data": str(data_dir), "resolution": 64, "buckets": True,
                          "batch_size": 1, "steps": 4, "timing_warmup_steps": 1, "schedule": SCHEDULE,
                          "lora": LoraSettings(rank=4, alpha=4.0), "output": str(data_dir.parent / "out"),
                          **changes})


@pytest.fixture(scope="module")
def roomy(data_dir):
    """The verdict with room to spare: the predicted peak of each bucket under the run's schedule."""
    return preflight(RunWorkspace(_config(data_dir), build_preset("flux")), 2**30)


def test_every_bucket_is_a_phase_and_the_largest_comes_first(roomy):
    train_phases = [p for p in roomy.phases if p.kind == "train"]
    assert [p.shape for p in train_phases] == ["1x16x8x8", "1x16x6x10"] and roomy.fits
    assert [p.share for p in train_phases] == [0.5, 0.5]
    large, small = (p.peak_bytes for p in train_phases)
    assert large > small > 0 and roomy.suggestion is None


def test_a_budget_between_the_buckets_fails_the_large_one_and_names_a_schedule_that_fits(data_dir, roomy, tmp_path):
    large, small = (p.peak_bytes for p in roomy.phases if p.kind == "train")
    budget = int((large + small) / 2 / (1 - MARGIN))  # the small bucket fits with headroom, the large does not
    verdict = preflight(RunWorkspace(_config(data_dir), build_preset("flux")), budget)
    assert not verdict.fits
    assert [(p.shape, p.fits) for p in verdict.phases] == [("1x16x8x8", False), ("1x16x6x10", True)]
    assert verdict.suggestion is not None and all(p.fits for p in verdict.suggested)
    text = verdict.render()
    assert "does NOT fit" in text and f"fits: {verdict.suggestion.mode}" in text
    # the run with the named schedule, measured: every step after the warm-up stays under the budget
    result = train(_config(data_dir, schedule=verdict.suggestion, output=str(tmp_path / "run"), steps=6),
                   bundle=build_preset("flux"), log=lambda line: None)
    shapes = {h["shape"] for h in result.history}
    assert shapes == {"1x16x8x8", "1x16x6x10"}  # both buckets trained
    assert max(h["peak_bytes"] for h in result.history[1:]) <= budget


def test_previews_are_a_phase_of_their_own(data_dir):
    verdict = preflight(RunWorkspace(_config(data_dir, validation_every=2), build_preset("flux")), 2**30)
    assert [p.kind for p in verdict.phases] == ["train", "train", "validation"]
    assert verdict.phases[-1].peak_bytes > 0 and verdict.phases[-1].fits


def test_plan_check_answers_with_its_exit_status_and_writes_the_verdict(data_dir, roomy, tmp_path, capsys):
    large = max(p.peak_bytes for p in roomy.phases)
    args = ["plan", "--check", "--data", str(data_dir), "--resolution", "64", "--buckets", "--no-checkpointing",
            "--batch-size", "1", "--rank", "4"]  # roomy's settings: its peaks are this run's
    assert cli.main(args + ["--budget", "1", "--output", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "preflight.json").read_text())["fits"] is True
    tight = f"{large * 0.9 / 2**30:.9f}"
    assert cli.main(args + ["--budget", tight, "--output", str(tmp_path / "no")]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "the schedule that would fit" in out
    # a schedule that saves memory: checkpointing or (when the timings favour it) attention offload;
    # never weight streaming on the CPU, where it saves nothing
    suggested = json.loads((tmp_path / "no" / "schedule.json").read_text())
    assert (suggested["gradient_checkpointing"] or suggested["gradient_checkpointing_offload_attention"]), suggested
    assert suggested["weight_offload"] == "none"


def test_train_with_a_budget_refuses_to_start_unless_told_and_writes_the_receipt(data_dir, roomy, tmp_path, capsys):
    large = max(p.peak_bytes for p in roomy.phases)
    tight = f"{large * 0.9 / 2**30:.9f}"
    args = ["train", "--data", str(data_dir), "--resolution", "64", "--buckets", "--no-checkpointing",
            "--rank", "4", "--steps", "3", "--budget", tight]
    assert cli.main(args + ["--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "not started: set the schedule it names" in err and not (tmp_path / "refused" / "lora.safetensors").exists()
    assert cli.main(args + ["--output", str(tmp_path / "anyway"), "--start-anyway"]) == 0
    report = json.loads((tmp_path / "anyway" / "report.json").read_text())
    assert report["preflight"]["fits"] is False and report["receipt"]["schedule"] == "none"
    assert "receipt: none" in capsys.readouterr().out


def test_the_receipt_weighs_each_active_option_against_its_neighbour(data_dir, roomy, tmp_path):
    from segmented_checkpointing.engine.measure.receipt import option_effects

    segmented = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
                                   gradient_checkpointing_offload_attention=True)
    assert {k: v.mode for k, v in neighbours(segmented).items()} == {
        "gradient_checkpointing": "none-offload-attn", "gradient_checkpointing_interval": "layer-stride4-offload-attn",
        "gradient_checkpointing_segment_stride": "interval2-offload-attn",
        "gradient_checkpointing_offload_attention": "interval2-stride4"}
    effects = {e["option"]: e for e in option_effects(roomy, segmented)}
    assert effects["gradient_checkpointing"]["saved_bytes"] > 0  # checkpointing saves memory here
    assert effects["gradient_checkpointing"]["no_effect"] is False
    # every block checkpointed whole: attention offload has nothing left to offload
    whole = CheckpointSchedule(gradient_checkpointing_offload_attention=True)
    offload = {e["option"]: e for e in option_effects(roomy, whole)}["gradient_checkpointing_offload_attention"]
    assert offload["saved_bytes"] == 0 and offload["no_effect"] is True


def test_a_budget_below_the_weights_does_not_fit_on_the_cpu_either(data_dir, roomy):
    """Budgets mean one thing everywhere: on the CPU the peaks hold the weights, the LoRA and the
    optimizer state too, so a budget below the frozen weights alone never fits a resident schedule."""
    frozen = sum(sum(per_block) for per_block in roomy.probes[next(iter(roomy.probes))].frozen_block_bytes.values())
    verdict = preflight(RunWorkspace(_config(data_dir), build_preset("flux")), int(0.9 * frozen))
    assert not verdict.fits and all(not p.fits for p in verdict.phases if p.kind == "train")
    assert all(p.peak_bytes > frozen for p in roomy.phases if p.kind == "train")
    assert "weights, LoRA and optimizer state included" in verdict.render()
    assert verdict.to_dict()["peak_scope"].startswith("each peak counts what the device holds")


def test_segckpt_plan_judges_its_choice_per_bucket_as_the_planner_node_does(data_dir, tmp_path, capsys):
    """Issue 37: one facade verb plans for both front ends: on bucketed data the command line's plan,
    like the Schedule Planner node's (tests/nodes/test_guardrail_nodes.py), judges its choice per bucket."""
    assert cli.main(["plan", "--data", str(data_dir), "--resolution", "64", "--buckets", "--batch-size", "1",
                     "--rank", "4", "--measure", "0", "--budget", "1", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pre-flight: none fits in 1 GiB" in out
    assert "ok  train 1x16x8x8" in out and "ok  train 1x16x6x10" in out  # one line per bucket
    assert "pre-flight: none fits in 1 GiB" in (tmp_path / "plan.txt").read_text()
