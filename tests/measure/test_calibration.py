"""The planner's time model: what a schedule adds (engine/measure/costs.py) priced at the calibrated
rates (engine/measure/costs.py), on a synthetic probe, so every value is exact. The counts
themselves are checked against real runs in tests/measure/test_planner.py. One real calibration:
a process measures it once per model and settings and remembers it."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.measure.costs import (
    BlockCost,
    Calibration,
    Work,
    _recompute_rates,
    calibration_key,
    forget_calibrations,
    seconds,
    work,
)
from segmented_checkpointing.engine.measure.planner import predict
from segmented_checkpointing.engine.measure.probe import Probe, plain_steps, probe, probe_steps
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun

RATES = Calibration(offload_s_per_tensor=1e-4, offload_s_per_byte=1e-9, recompute_s_per_call=2e-4,
                    recompute_s_per_tensor=1e-5, stream_s_per_tensor=3e-6)


def _probe(calibration: Calibration = RATES) -> Probe:
    """2 + 2 flux blocks: 30 saved tensors each (4 in the FFN), 10 ms forward (1 ms FFN), the
    attention saving 5 tensors of 200 bytes, 4000 frozen bytes."""
    blocks = {name: [BlockCost(name, i, act=1000, carried=100, attn=1000, fwd_s=0.01, ffn_s=0.001, saved_tensors=30,
                               ffn_tensors=4, attn_tensors=5, attn_copied=1000) for i in range(2)]
              for name in ("double", "single")}
    return Probe("flux", "cpu", blocks, peak_bytes=30_000, sec_per_step=0.1,
                 offload_s_per_tensor=calibration.offload_s_per_tensor,
                 offload_s_per_byte=calibration.offload_s_per_byte,
                 frozen_block_bytes={"double": [4000] * 2, "single": [4000] * 2}, h2d_s_per_byte=1e-9,
                 held_bytes=20_000, recompute_s_per_call=calibration.recompute_s_per_call,
                 recompute_s_per_tensor=calibration.recompute_s_per_tensor,
                 stream_s_per_tensor=calibration.stream_s_per_tensor)


@pytest.mark.parametrize("keys, expected", [
    ({"gradient_checkpointing": False}, Work()),
    ({}, Work(recompute_s=0.04, calls=4, recompute_tensors=120)),
    ({"gradient_checkpointing_interval": 2}, Work(recompute_s=0.04, calls=2, recompute_tensors=120)),
    ({"gradient_checkpointing_backend": "torch-ffn"}, Work(recompute_s=0.004, calls=4, recompute_tensors=16)),
    ({"gradient_checkpointing_backend": "unsloth"}, Work(recompute_s=0.04, calls=4, recompute_tensors=120,
                                                         offload_tensors=4 + 4 * 1, offload_bytes=400)),
    ({"gradient_checkpointing": False, "gradient_checkpointing_offload_attention": True},
     Work(offload_tensors=20, offload_bytes=4000)),
    ({"gradient_checkpointing": False, "weight_offload": "stream"}, Work(stream_tensors=120)),
    ({"weight_offload": "stream"}, Work(recompute_s=0.04, calls=4, recompute_tensors=120)),
])
def test_what_a_schedule_adds_is_counted_per_block(keys, expected):
    added = work(get_family("flux"), _probe().blocks, CheckpointSchedule(**keys)).work
    counts = lambda w: (w.calls, w.recompute_tensors, w.offload_tensors, w.offload_bytes, w.stream_tensors)  # noqa: E731
    assert counts(added) == counts(expected)
    assert added.recompute_s == pytest.approx(expected.recompute_s, rel=1e-12)


def test_predicted_seconds_are_the_plain_step_plus_the_work_at_the_calibrated_rates():
    probe_ = _probe()
    layer = predict(probe_, CheckpointSchedule()).sec_per_step
    assert layer == pytest.approx(0.1 + 0.04 + 4 * 2e-4 + 120 * 1e-5, rel=1e-12)
    offload = predict(probe_, CheckpointSchedule(gradient_checkpointing=False,
                                                 gradient_checkpointing_offload_attention=True)).sec_per_step
    assert offload == pytest.approx(0.1 + 20 * 1e-4 + 4000 * 1e-9, rel=1e-12)
    # streaming on the CPU: every unit copied in forward and in backward, plus the hook per saved tensor
    streamed = predict(probe_, CheckpointSchedule(gradient_checkpointing=False, weight_offload="stream")).sec_per_step
    assert streamed == pytest.approx(0.1 + 2 * 16_000 * 1e-9 + 120 * 3e-6, rel=1e-12)
    assert seconds(RATES, Work()) == 0.0


def test_the_recompute_rates_are_solved_from_the_block_and_the_ffn_runs():
    per_call, per_tensor = 3e-4, 2e-5
    layer = Work(recompute_s=0.04, calls=16, recompute_tensors=941)
    ffn = Work(recompute_s=0.002, calls=16, recompute_tensors=40)
    extra = lambda w: w.recompute_s + w.calls * per_call + w.recompute_tensors * per_tensor  # noqa: E731
    assert _recompute_rates((extra(layer), layer), (extra(ffn), ffn)) == pytest.approx((per_call, per_tensor))
    # without the FFN run, or where noise makes a solved rate negative: one rate per tensor
    assert _recompute_rates((extra(layer), layer), None) == pytest.approx(
        (0.0, (16 * per_call + 941 * per_tensor) / 941))
    assert _recompute_rates((extra(layer), layer), (0.5, ffn))[0] == 0.0
    assert _recompute_rates(None, None) == (0.0, 0.0)


def test_a_process_calibrates_once_per_model_and_settings(monkeypatch):
    """The second probe of the same model runs only its plain run and takes the first's rates; a
    run that is not the trainer's own, or other settings, never share one. The recorded run's model
    copy (on a GPU, the whole model in device memory) is freed before the calibration starts its
    own, by reference counts alone (the cyclic collector off)."""
    config, bundle = TrainConfig.create(family="flux", resolution=32, output="unused"), build_preset("flux")
    forget_calibrations()
    models, alive_at_start, start = [], [], RunWorkspace.start

    def watched(self, *args, **kwargs):
        alive_at_start.append([model() is not None for model in models])
        run = start(self, *args, **kwargs)
        models.append(weakref.ref(run.bundle.transformer))
        return run

    monkeypatch.setattr(RunWorkspace, "start", watched)
    measured = []
    for _ in range(2):
        steps = []
        gc.collect()
        gc.disable()
        try:
            with RunWorkspace(config, bundle, on_step=lambda done, total: steps.append(done)) as workspace:
                measured.append((probe(workspace), steps[-1]))
        finally:
            gc.enable()
    assert alive_at_start[1] == [False]  # the first calibration run starts with the recorded run's copy gone
    (first, first_steps), (second, second_steps) = measured
    assert second_steps == plain_steps(1) < first_steps
    assert second.calibration == dataclasses.replace(first.calibration, plain_seconds=())
    assert first_steps == probe_steps(1)  # the calibration ran (its rates may measure 0 on a loaded machine)
    key = calibration_key(RunWorkspace(config, bundle), 1)
    assert key == calibration_key(RunWorkspace(config.replace(resolution=64), bundle), 1)  # per call, tensor, byte
    for other in (config.replace(lora_rank=8), config.replace(device="cpu", weight_offload="stream")):
        assert calibration_key(RunWorkspace(other, bundle), 1) != key
    assert calibration_key(RunWorkspace(config, bundle), 2) != key
    stand_in = lambda *args, **kwargs: TrainingRun(*args, **kwargs)  # noqa: E731
    assert calibration_key(RunWorkspace(config, bundle, start_run=stand_in), 1) is None
    forget_calibrations()

