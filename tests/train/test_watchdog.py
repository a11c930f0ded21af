"""The slowdown and memory-growth watchdog: a 2x slowdown from step 8 is reported once, naming step
8, with its likely cause; a steady run reports nothing; a real run with an injected slowdown says so
in its log and report."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun
from segmented_checkpointing.engine.train.monitor import Watchdog

pytestmark = pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.model.text_encoders.TextEncoderWarning")
MIB = 1 << 20


def _feed(dog: Watchdog, seconds: list[float], peaks: list[int] | None = None, shape: str = "2x16x4x4"):
    found = []
    for i, s in enumerate(seconds):
        found += dog.observe(i + 1, s, (peaks or [10 * MIB] * len(seconds))[i], shape)
    return found


def test_a_2x_slowdown_from_step_8_is_reported_once_naming_step_8():
    steady = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.09]  # steps 1-7 (1-2 warm-up, 3-5 baseline)
    found = _feed(Watchdog(warmup=2), steady + [0.20, 0.21, 0.19, 0.22, 0.20, 0.20, 0.21, 0.20])
    assert len(found) == 1
    report = found[0]
    assert (report["kind"], report["step"], report["detected_at"]) == ("slowdown", 8, 12)
    assert report["ratio"] == pytest.approx(0.20 / 0.10, abs=0.01) and "from step 8" in report["message"]
    assert "likely cause" in report["message"] and "what helps" in report["message"]


def test_a_steady_run_with_jitter_reports_nothing():
    jitter = [0.10, 0.13, 0.09, 0.16, 0.10, 0.14, 0.08, 0.16, 0.11, 0.09, 0.17, 0.10, 0.12, 0.15, 0.09, 0.1]
    assert _feed(Watchdog(warmup=2), jitter) == []


def test_slow_steps_that_do_not_last_the_window_are_not_a_slowdown():
    assert _feed(Watchdog(warmup=0, window=5), [0.1] * 3 + [0.3] * 4 + [0.1] + [0.3] * 4) == []


def test_each_bucket_has_its_own_baseline():
    """A larger bucket is slower by nature: not a slowdown."""
    dog = Watchdog(warmup=0)
    found = _feed(dog, [0.1] * 4, shape="1x16x4x4") + _feed(dog, [0.4] * 8, shape="1x16x8x8")
    assert found == []


def test_causes_host_spill_and_validation():
    spill = Watchdog(warmup=0, at_capacity=lambda: True)
    (report,) = _feed(spill, [0.1] * 3 + [0.5] * 5)
    assert "host spill" in report["cause"] and "sysmem fallback" in report["helps"]
    previews = Watchdog(warmup=0)
    _feed(previews, [0.1] * 4)
    previews.previews_ran(4)
    (report,) = [f for i in range(5, 10) for f in previews.observe(i, 0.5, 10 * MIB, "2x16x4x4")]
    assert report["step"] == 5 and "validation previews that ran after step 4" in report["cause"]


def test_memory_growth_between_steps_of_one_shape_is_reported_once():
    peaks = [10 * MIB] * 5 + [10 * MIB + 200_000, 12 * MIB, 14 * MIB]  # noise, then growth at step 7
    found = _feed(Watchdog(warmup=0), [0.1] * 8, peaks)
    assert [(f["kind"], f["step"]) for f in found] == [("memory", 7)]
    assert "12.0 MiB against 10.0 MiB" in found[0]["message"]


def test_off_reports_nothing():
    assert _feed(Watchdog(warmup=0, factor=0), [0.1] * 3 + [1.0] * 10) == []


@pytest.mark.parametrize("key, value", [("watchdog_slowdown", 1.0), ("watchdog_slowdown", -2),
                                        ("watchdog_window", 0)])
def test_settings_are_checked_by_name(key, value):
    with pytest.raises(ConfigError, match=key):
        TrainConfig.from_dict({key: value})


def test_a_run_with_an_injected_slowdown_from_step_8_reports_it(tmp_path):
    """From step 8 a sleep in the model's forward of twice the steady steps' median time makes the
    steps about 3x slower: real time, measured like any other (whatever this machine's speed)."""
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    write_sample_dataset(tmp_path / "data")
    config = TrainConfig.create(family="flux", output=str(tmp_path / "run"), resolution=32, steps=13, batch_size=1,
                         lora=LoraSettings(rank=4, alpha=4.0), timing_warmup_steps=2, data=str(tmp_path / "data"))
    lines, extra, seconds = [], {"sleep": 0.0}, []
    run = TrainingRun(config, bundle=build_preset("flux"), log=lines.append)
    for record in run:
        if record.step == 1:
            run.context.model.register_forward_pre_hook(lambda *_: time.sleep(extra["sleep"]))
        seconds.append(record.timing.seconds)
        if record.step == 7:  # steps 8, 9, ... sleep twice the median of steps 3-7
            extra["sleep"] = 2 * statistics.median(seconds[2:7])
    warnings = [line for line in lines if line.startswith("segckpt: warning: slowdown")]
    assert len(warnings) == 1 and "slowdown from step 8" in warnings[0]
    report = json.loads((run.output / "report.json").read_text())
    assert [(w["kind"], w["step"]) for w in report["watchdog"]] == [("slowdown", 8)]
    assert [w["kind"] for w in report["steps"][11]["watchdog"]] == ["slowdown"]  # after the 5th slow step (12)
    assert config.to_dict()["watchdog_slowdown"] == 1.5
