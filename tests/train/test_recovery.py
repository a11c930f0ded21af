"""Out-of-memory recovery: the ladder of cheaper schedules, and a run that runs out of memory at
step 3 switches, retries the step and ends exactly where a run with the new schedule from step 3
on ends."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun
from segmented_checkpointing.engine.train.recovery import OutOfMemoryStop, cheaper_schedules, is_out_of_memory

# the tiny preset has no language model: its stand-in embedder's notice is expected here
pytestmark = pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.model.text_encoders.TextEncoderWarning")
SEGMENTED = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)


@pytest.mark.parametrize("family, schedule, ladder", [
    ("flux", SEGMENTED, ["interval2-stride4-unsloth-ffn", "interval2-stride4-unsloth", "interval2-unsloth",
                         "layer-unsloth", "layer-unsloth-offload-attn", "layer-unsloth-offload-attn-stream"]),
    ("flux", CheckpointSchedule(gradient_checkpointing=False),
     ["layer-torch-ffn", "layer", "layer-unsloth-ffn", "layer-unsloth", "layer-unsloth-offload-attn",
      "layer-unsloth-offload-attn-stream"]),
    ("flux", CheckpointSchedule(gradient_checkpointing_backend="unsloth", gradient_checkpointing_offload_attention=True),
     ["layer-unsloth-offload-attn-stream"]),
    ("flux", CheckpointSchedule(gradient_checkpointing_backend="unsloth", gradient_checkpointing_offload_attention=True,
                                weight_offload="stream"), []),
    # no FFN boundary and no routed attention (docs/SCHEDULES.md "Families named by the documents"):
    # those rungs are skipped
    ("ideogram4", SEGMENTED, ["interval2-stride4-unsloth", "interval2-unsloth", "layer-unsloth", "layer-unsloth-stream"]),
])
def test_the_ladder_follows_the_documents_order_and_what_the_family_can_run(family, schedule, ladder):
    assert [s.mode for s in cheaper_schedules(schedule, get_family(family))] == ladder


@pytest.mark.parametrize("exc, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_out_of_memory_errors_are_recognised(exc, oom):
    assert is_out_of_memory(exc) is oom


def _config(tmp_path, name, **changes):
    base = TrainConfig.create(family="flux", output=str(tmp_path / name), resolution=32, steps=6, batch_size=2,
                       lora=LoraSettings(rank=4, alpha=4.0, dropout=0.1), timing_warmup_steps=0,
                       schedule=SEGMENTED, data=str(tmp_path / "data"))
    return base.replace(**changes)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("oom")
    write_sample_dataset(root / "data")
    return root


def _oom_in_recompute_at_step(run: TrainingRun, step: int, schedule: CheckpointSchedule) -> None:
    """From ``step`` on, the first block raises an out-of-memory error while it is recomputed in
    backward (the later blocks' LoRA gradients already exist), under ``schedule`` only."""
    ctx = run.context
    first = ctx.family.blocks(ctx.model, ctx.family.block_lists[0])[0]

    def hook(_module, _args):
        if ctx.config.schedule == schedule and ctx.runner.stats.recomputed_blocks > 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")

    first.register_forward_pre_hook(hook)


def _quiet_run(config, lines=None):
    return TrainingRun(config, bundle=build_preset("flux"), log=lines.append if lines is not None else print)


def test_oom_at_step_3_switches_and_equals_a_run_with_the_new_schedule_from_step_3(data_dir):
    lines = []
    run = _quiet_run(_config(data_dir, "recovered"), lines)
    records = []
    for record in run:
        records.append(record)
        if record.step == 2:
            _oom_in_recompute_at_step(run, 3, SEGMENTED)
    new = cheaper_schedules(SEGMENTED, get_family("flux"))[0]
    assert [len(r.schedule_switches) for r in records] == [0, 0, 1, 0, 0, 0]
    switch = records[2].schedule_switches[0]
    assert (switch["step"], switch["from"], switch["to"]) == (3, "interval2-stride4", new.mode)
    assert "injected" in switch["error"]
    assert any("step 3: out of memory with interval2-stride4" in line and new.mode in line for line in lines)
    report = json.loads((run.output / "report.json").read_text())
    assert [s["step"] for s in report["schedule_switches"]] == [3] and report["plan"]["mode"] == new.mode
    assert report["config"]["schedule"] == new.to_dict() and report["totals"]["steps"] == 6

    # the same data, noise and dropout: 2 steps with the old schedule, then the new one from step 3
    first = _quiet_run(_config(data_dir, "reference"))
    for record in first:
        if record.step == 2:
            first.stop()
    second = _quiet_run(_config(data_dir, "reference", schedule=new, resume=True))
    reference = list(second)
    assert [r.loss for r in records] == pytest.approx([r["loss"] for r in first.history[:2]] +
                                                      [r.loss for r in reference], abs=1e-6)
    got, expected = load_file(run.output / "lora.safetensors"), load_file(second.output / "lora.safetensors")
    assert got.keys() == expected.keys()
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-6


def test_oom_with_recovery_off_stops_and_keeps_the_last_good_step(data_dir):
    run = _quiet_run(_config(data_dir, "stopped", on_oom="stop"))
    with pytest.raises(OutOfMemoryStop, match=r"step 3 ran out of memory .* with on_oom=stop"):
        for record in run:
            if record.step == 2:
                _oom_in_recompute_at_step(run, 3, SEGMENTED)
    report = json.loads((run.output / "report.json").read_text())
    assert report["totals"]["steps"] == 2 and "on_oom=stop" in report["stopped"]
    assert json.loads(json.dumps(report["schedule_switches"])) == []


def test_oom_in_the_optimizer_update_is_not_retried(data_dir):
    run = _quiet_run(_config(data_dir, "update"))
    with pytest.raises(OutOfMemoryStop, match="during the optimizer update"):
        for record in run:
            if record.step == 1:
                def fail(*_args, **_kwargs):
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                run.context.optimizer.step = fail


def test_oom_with_no_cheaper_schedule_names_the_last_one(data_dir):
    last = CheckpointSchedule(gradient_checkpointing_backend="unsloth", gradient_checkpointing_offload_attention=True,
                              weight_offload="stream")
    run = _quiet_run(_config(data_dir, "bottom", schedule=last))
    with pytest.raises(OutOfMemoryStop, match="no schedule saves more memory than layer-unsloth-offload-attn-stream"):
        for record in run:
            if record.step == 1:
                _oom_in_recompute_at_step(run, 2, last)


def test_on_oom_is_checked_by_name():
    with pytest.raises(ConfigError, match="on_oom='retry'.*switch, stop"):
        TrainConfig.create(on_oom="retry")
