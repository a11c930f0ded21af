"""Frame counts as a measurement dimension: ``sweep --frames``, ``plan --frames``, the refusals."""

from __future__ import annotations

import json

import pytest

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.families.limits import token_count
from segmented_checkpointing.engine.measure import sweep as sweep_module
from segmented_checkpointing.engine.measure.planning import plan_for_budget
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.model.bundle import build_preset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NONE, PER_BLOCK = CheckpointSchedule(gradient_checkpointing=False), CheckpointSchedule()


def test_sweep_over_frames_prints_one_table_per_count_and_peak_grows(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_module, "sweep_schedules", lambda *_a: [NONE, PER_BLOCK])  # two modes keep it short
    status = cli.main(["sweep", "--family", "wan", "--frames", "1", "5", "--resolution", "64", "--warmup", "1",
                       "--measure", "1", "--output", str(tmp_path / "sweep")])
    out = capsys.readouterr().out
    assert status == 0
    assert out.count("# Checkpointing sweep: wan") == 2
    assert "wan, 1 frame (1 latent frame, 16 tokens per sample)" in out
    assert "wan, 5 frames (2 latent frames, 32 tokens per sample)" in out  # 8x8 latents, patch (1, 2, 2)
    peaks = {}
    for n in (1, 5):
        cells = json.loads((tmp_path / "sweep" / f"frames-{n}" / "sweep.json").read_text())["cells"]
        peaks[n] = {c["mode"]: c["peak_bytes"] for c in cells}
        assert all(c["status"] == "ok" for c in cells)
    assert peaks[5]["none"] > peaks[1]["none"]
    assert peaks[5]["none"] - peaks[1]["none"] > peaks[5]["layer"] - peaks[1]["layer"]


def test_plan_predicts_per_frame_count(tmp_path):
    config = TrainConfig.create(family="wan", resolution=64, output=str(tmp_path / "out"),
                                lora=LoraSettings(rank=4, alpha=4.0))
    measure = MeasureConfig.create(frames=(1, 5), timing_steps=0)
    choice = plan_for_budget(RunWorkspace(config, build_preset("wan")), measure, 2**30)
    text = choice.render()
    assert sorted(choice.by_frames) == [1, 5]
    assert "## 1 frame (1 latent frame, 16 tokens per sample)" in text
    assert "## 5 frames (2 latent frames, 32 tokens per sample)" in text
    assert f"predicted peak of {choice.chosen.schedule.mode} per frame count: 1 frames" in text
    assert choice.by_frames[5].probe.peak_bytes > choice.by_frames[1].probe.peak_bytes


@pytest.mark.parametrize("family, frames, says", [
    ("wan", "4", "frames=4 is invalid for wan: allowed 4k+1"),
    ("flux", "5", "frames=5 is invalid for flux: allowed 1 (flux is an image family"),
])
def test_frames_refused_in_one_line(family, frames, says, capsys, tmp_path):
    for command in ("sweep", "plan"):
        extra = ["--budget", "8"] if command == "plan" else []
        status = cli.main([command, "--family", family, "--frames", frames, "--output", str(tmp_path), *extra])
        err = capsys.readouterr().err.strip()
        assert status == 2 and says in err and len(err.splitlines()) == 1


def test_token_count_is_latent_frames_times_patches():
    wan = get_family("wan")
    assert token_count(wan, {"patch_size": (1, 2, 2)}, (16, 21, 60, 104)) == 21 * 30 * 52
    assert token_count(wan, {"patch_size": (1, 2, 2)}, (16, 60, 104)) == 30 * 52
    assert token_count(get_family("ltxvideo"), {"patch_size": 1, "patch_size_t": 1}, (128, 5, 4, 4)) == 80
