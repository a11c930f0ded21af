"""Schedule planner: the probe's measurements, predictions against a measured sweep, the choice."""

from __future__ import annotations

import dataclasses
import json

import pytest

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.measure.costs import work
from segmented_checkpointing.engine.measure.planner import PlannerError, choose, parse_budget, predict
from segmented_checkpointing.engine.measure.planning import plan_for_budget
from segmented_checkpointing.engine.measure.probe import probe
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.measure.sweep import sweep_schedules
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CANDIDATES = sweep_schedules()  # every backend, with and without attention offload


def _config(family: str) -> TrainConfig:
    return TrainConfig.create(family=family, resolution=128, output="unused", lora=LoraSettings(rank=8, alpha=8.0))


HANDFUL = ["none", "none-offload-attn", "layer", "interval2-stride4", "layer-torch-ffn", "layer-unsloth",
           "interval2-unsloth-ffn-offload-attn", "interval2-stride4-torch-ffn-offload-attn"]
"""A representative handful: no checkpointing, per-block, a stride, each backend scope with and
without offload; bench/planner_accuracy.py checks all 26 candidates (and the speed criterion)."""


@pytest.mark.parametrize("family", ["flux", "wan", "sd3"])
def test_predictions_match_measured_peaks_and_the_choice_fits(family):
    config, bundle = _config(family), build_preset(family)
    schedules = {s.mode: s for s in CANDIDATES}
    with RunWorkspace(config, bundle) as workspace:  # the data is encoded once for every run here
        measured_probe = probe(workspace)
        blocks = [c for costs in measured_probe.blocks.values() for c in costs]
        assert all(c.act > 0 and c.grad > 0 and c.fwd_s > 0 for c in blocks)
        assert 0 < measured_probe.activation_bytes < measured_probe.peak_bytes
        runs = {mode: workspace.run(schedules[mode], 1, 1) for mode in HANDFUL}
        measured = {mode: peak_after_warmup(result, 1) for mode, result in runs.items()}
        # the time model's counts are what each run did: checkpoint calls, tensors offloaded
        counted = {mode: (r.history[-1]["checkpoint_calls"], r.history[-1]["offloaded_tensors"]) for mode, r in runs.items()}
        added = {mode: work(get_family(family), measured_probe.blocks, schedules[mode]).work for mode in HANDFUL}
        assert {mode: (a.calls, a.offload_tensors) for mode, a in added.items()} == counted
        assert counted["layer"][0] == len(blocks) and counted["none-offload-attn"][1] > 0
        for mode, real in measured.items():
            guess = predict(measured_probe, schedules[mode]).peak_bytes
            # within 10% of what the step adds to the weights held before it (device-terms peaks)
            assert abs(guess - real) <= 0.10 * (real - measured_probe.held_bytes), (family, mode, guess, real)
        for share in (0.25, 0.5, 0.75):
            budget = int(share * measured["none"])
            try:
                chosen = choose(measured_probe, budget).chosen
            except PlannerError:
                assert min(measured.values()) > budget * 0.95, (family, share)
                continue
            real = peak_after_warmup(workspace.run(chosen.schedule, 1, 1), 1)
            assert real <= budget, (family, share, chosen.schedule.mode, real, budget)


def test_nothing_fits_names_the_smallest_peak():
    with RunWorkspace(_config("wan"), build_preset("wan")) as workspace:
        measured_probe = probe(workspace)
    assert predict(measured_probe, CheckpointSchedule(gradient_checkpointing=False)).peak_bytes == measured_probe.peak_bytes
    with pytest.raises(PlannerError, match="budget=.* is too small: the smallest predicted peak is"):
        choose(measured_probe, 1024)
    generous = choose(measured_probe, 10 * measured_probe.peak_bytes)
    assert generous.chosen.schedule.mode == "none"  # fits: the documents say leave checkpointing off


@pytest.mark.parametrize("value, ok", [("device", True), ("2.5", True), (3, True), ("0", False), ("lots", False),
                                       ("inf", False), ("nan", False), ("-1", False)])
def test_budget_parsing(value, ok):
    if ok:
        assert parse_budget(value) > 0
    else:
        with pytest.raises(PlannerError, match="budget="):
            parse_budget(value)


def test_segckpt_plan_prints_the_choice_and_writes_its_keys(tmp_path, capsys):
    assert cli.main(["plan", "--resolution", "64", "--budget", "device", "--measure", "1", "--rank", "4",
                     "--nproc", "2", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "->none " in out and "measured none:" in out
    ranks = json.loads((tmp_path / "nproc.json").read_text())  # --nproc 2: both per-rank peaks, the last line
    assert ranks["nproc"] == 2 and ranks["recommended"] == "ddp" and ranks["fsdp_mode"] == "none"
    assert ranks["ddp_peak_bytes"] > ranks["fsdp_peak_bytes"] > 0
    assert (tmp_path / "plan.txt").read_text().splitlines()[-1].startswith("2 processes, per-rank peak predicted: DDP")
    assert (tmp_path / "schedule.json").is_file() and (tmp_path / "plan.txt").is_file()
    assert cli.main(["plan", "--budget", "nope", "--output", str(tmp_path)]) == 2


def test_ctrl_c_while_plan_measures_keeps_the_prediction_marked_not_measured(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the head-to-head: plan.txt and schedule.json hold the predicted choice, with a note
    that it was not measured; one line, exit 130, no traceback."""
    from segmented_checkpointing.engine.measure import planning

    steps = []

    def interrupted(*args, **kwargs):  # Ctrl-C while the candidates are timed in lockstep
        steps.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(planning, "lockstep_runs", interrupted)
    status = cli.main(["plan", "--resolution", "64", "--budget", "device", "--measure", "2", "--rank", "4",
                       "--output", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 130 and steps == [1] and "Traceback" not in captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"segckpt: interrupted while measuring: {tmp_path / 'plan.txt'} and schedule.json hold "
                           "the predicted choice none (not measured")
    text = (tmp_path / "plan.txt").read_text()
    assert "was interrupted: the choice is the prediction, not measured" in text and "measured none:" not in text
    assert json.loads((tmp_path / "schedule.json").read_text())["gradient_checkpointing"] is False


def test_a_choice_that_measures_over_budget_falls_back_to_the_next_candidate():
    class Pessimistic(TrainingRun):  # "none" measures far over any budget; the rest as measured
        def __iter__(self):
            yield from super().__iter__()
            if self.config.schedule.mode == "none" and self.config.steps == 2:
                for record in self.result.history:
                    record["peak_bytes"] = record["device_peak_bytes"] = 10**12

    config, bundle = TrainConfig.create(family="flux", resolution=64, output="unused"), build_preset("flux")
    choice = plan_for_budget(RunWorkspace(config, bundle, Pessimistic), MeasureConfig.create(timing_steps=1), 2**30)
    assert choice.chosen.schedule.mode != "none" and choice.measured_peak_bytes <= 2**30
    assert choice.notes and choice.notes[0].startswith("none measured") and "tried the next candidate" in choice.render()


def test_contenders_hedge_the_offloader_calibration_and_measuring_keeps_the_fastest():
    """The planner times the choices it would make had the offloader cost half and twice the
    calibrated value; a contender that measures slower than predicted (here: the prediction's
    choice, made 3x slower by its run) loses to one timed beside it."""
    from segmented_checkpointing.engine.measure.planner import contenders

    config, bundle = TrainConfig.create(family="flux", resolution=64, output="unused"), build_preset("flux")
    with RunWorkspace(config, bundle) as workspace:
        measured_probe = probe(workspace)
    held = measured_probe.held_bytes  # the weights: 0.6 of what the step adds to them
    budget = int(held + 0.6 * (measured_probe.peak_bytes - held))
    assert [p.schedule.mode for p in contenders(choose(measured_probe, 10 * measured_probe.peak_bytes))] == ["none"]

    def at(seconds_per_tensor):
        return dataclasses.replace(measured_probe, offload_s_per_tensor=seconds_per_tensor, offload_s_per_byte=0.0)

    costs = [1e-7 * 2**k for k in range(24)]
    offloads = [choose(at(c), budget).chosen.offloaded_tensors > 0 for c in costs]
    assert offloads[0] and not offloads[-1]  # cheap offload: an offloading choice; dear: recompute
    k = offloads.index(False)  # the first cost at which the choice stops offloading
    choice = choose(at(costs[k]), budget)
    timed = [p.schedule.mode for p in contenders(choice)]
    assert timed[0] == choice.chosen.schedule.mode
    assert choose(at(costs[k - 1]), budget).chosen.schedule.mode in timed  # half the cost
    if k + 1 < len(costs):
        assert choose(at(costs[k + 1]), budget).chosen.schedule.mode in timed  # twice the cost

    predicted = choice.chosen.schedule.mode

    class Slowed(TrainingRun):
        def __iter__(self):
            yield from super().__iter__()
            if self.config.schedule.mode == predicted:
                for record in self.result.history:
                    record["seconds"] *= 3

    planned = plan_for_budget(RunWorkspace(config, bundle, Slowed), MeasureConfig.create(timing_steps=2), budget,
                              probe_=at(costs[k]))
    measured = [p for p in planned.candidates if p.measured_sec_per_step is not None]
    assert len(measured) >= 2 and planned.chosen.schedule.mode != predicted
    assert planned.chosen.relative_time < 0.6 and planned.measured_peak_bytes <= budget
    assert f"->{planned.chosen.schedule.mode}" in planned.render() and "(x1.000)" in planned.render()


def test_the_progress_total_is_the_work_done_and_the_bar_ends_full():
    """The planner's total follows what it decides to run: the probe and its calibration, then the
    contenders it times (announced as the most it could time, corrected when it knows them). With
    a roomy budget only ``none`` is timed: the probe's steps and 1 + 1 timed steps, and the last
    report is (done, done), made by the last step itself. Planned again in the same process, the
    probe takes the calibration it remembers and its total drops the calibration's steps."""
    from segmented_checkpointing.engine.measure.costs import forget_calibrations
    from segmented_checkpointing.engine.measure.probe import probe_steps

    config, bundle = TrainConfig.create(family="flux", resolution=64, output="unused"), build_preset("flux")
    forget_calibrations()
    for calibrate in (True, False):
        seen = []
        workspace = RunWorkspace(config, bundle, on_step=lambda done, total: seen.append((done, total)))
        choice = plan_for_budget(workspace, MeasureConfig.create(timing_steps=1), 2**30)
        assert [p.schedule.mode for p in choice.candidates if p.measured_sec_per_step is not None] == ["none"]
        done = probe_steps(1, calibrate) + 2
        assert [d for d, _ in seen] == list(range(1, done + 1)) and seen[-1] == (done, done)
        assert all(d <= t for d, t in seen) and seen[0][1] == probe_steps(1, calibrate) + 3 * 2  # up to 3 contenders
