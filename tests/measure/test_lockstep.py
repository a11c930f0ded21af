"""Lockstep timing: one step of each schedule in turn, real runs unchanged, errors never deadlock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.measure.lockstep import (
    lockstep_runs,
    paired_difference,
    paired_ratio,
)
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.measure.sweep import sweep_schedules
from segmented_checkpointing.engine.model.bundle import build_preset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MODES = {s.mode: s for s in sweep_schedules()}


def _recording_runs(order: list, fail: str | None = None, fail_at: int = 0):
    """Runs that only log ``(mode, step)`` in the order their steps run."""

    class Run:
        def __init__(self, config, bundle, log, cache_dir):
            self.config, self.result = config, None

        def __iter__(self):
            history = []
            for step in range(1, self.config.steps + 1):
                if self.config.schedule.mode == fail and step == fail_at:
                    raise RuntimeError(f"{fail} broke at step {step}")
                order.append((self.config.schedule.mode, step))
                history.append({"seconds": 1.0 + step, "peak_bytes": 0})
                yield SimpleNamespace(step=step)
            self.result = SimpleNamespace(history=history)

    return Run


def test_steps_after_the_first_alternate_between_schedules():
    order: list = []
    schedules = [MODES["none"], MODES["layer"], MODES["interval2"]]
    config, bundle = TrainConfig.create(family="flux", output="unused"), build_preset("flux")
    with RunWorkspace(config, bundle, _recording_runs(order)) as workspace:
        results = lockstep_runs(workspace, schedules, warmup_steps=1, measured_steps=3)
    assert len(results) == 3 and all(len(r.history) == 4 for r in results)
    assert order == [(s.mode, k) for k in (1, 2, 3, 4) for s in schedules]
    assert paired_ratio(results[0], results[1], 1) == 1.0 and paired_difference(results[0], results[2], 1) == 0.0


def test_a_failing_run_raises_and_the_others_still_finish():
    order: list = []
    config, bundle = TrainConfig.create(family="flux", output="unused"), build_preset("flux")
    with RunWorkspace(config, bundle, _recording_runs(order, fail="layer", fail_at=3)) as workspace, \
            pytest.raises(RuntimeError, match="layer broke at step 3"):
        lockstep_runs(workspace, [MODES["none"], MODES["layer"]], 1, 4)
    assert ("none", 5) in order and ("layer", 3) not in order


def test_bad_arguments_are_refused_by_name():
    config, bundle = TrainConfig.create(family="flux", output="unused"), build_preset("flux")
    with RunWorkspace(config, bundle) as workspace, pytest.raises(ValueError, match="warmup_steps=0"):
        lockstep_runs(workspace, [MODES["none"]], warmup_steps=0)


def test_real_lockstep_runs_measure_what_a_run_alone_measures():
    """Interleaved in one thread, the runs keep their CPU trackers, saved-tensor hooks and model
    copies apart: the peaks and losses equal those of the same runs made one after the other."""
    config = TrainConfig.create(family="flux", resolution=64, output="unused")
    bundle = build_preset("flux")
    schedules = [CheckpointSchedule(gradient_checkpointing=False), MODES["interval2-unsloth-ffn-offload-attn"]]
    with RunWorkspace(config, bundle) as workspace:
        together = lockstep_runs(workspace, schedules, warmup_steps=1, measured_steps=1)
    for schedule, result in zip(schedules, together):
        with RunWorkspace(config, bundle) as workspace:  # a workspace of its own, as a run alone has
            alone = workspace.run(schedule, 1, 1)
        assert [h["peak_bytes"] for h in result.history] == [h["peak_bytes"] for h in alone.history]
        assert [h["loss"] for h in result.history] == pytest.approx([h["loss"] for h in alone.history], rel=1e-5)
    assert together[0].history[-1]["peak_bytes"] > together[1].history[-1]["peak_bytes"]


def test_a_workspace_opens_afresh_and_never_twice_at_once():
    """The sweep opens its workspace once per frame count: each opening counts its own steps; a
    workspace still open refuses a second opening (a measurement given an open one by mistake)."""
    order: list = []
    config, bundle, seen = TrainConfig.create(family="flux", output="unused"), build_preset("flux"), []
    workspace = RunWorkspace(config, bundle, _recording_runs(order), on_step=lambda done, total: seen.append(done))
    for _ in range(2):
        with workspace:
            lockstep_runs(workspace, [MODES["none"]], warmup_steps=1, measured_steps=1)
            with pytest.raises(RuntimeError, match="open already"):
                workspace.__enter__()
    assert seen == [1, 2, 1, 2] and workspace.done == 2
    again = workspace.fresh(schedule=MODES["layer"])  # counts on from the 2 steps done
    with again:
        lockstep_runs(again, [MODES["none"]], warmup_steps=1, measured_steps=1)
    assert seen[4:] == [3, 4] and again.config.schedule == MODES["layer"]
