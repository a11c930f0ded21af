"""Training: resume equals an uninterrupted run; the LoRA file; the report; inference mode."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import full_and_resumed
from safetensors import safe_open
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.optim import LR_SCHEDULES, LRSchedule
from segmented_checkpointing.engine.config.train import warn_resume_schedule
from segmented_checkpointing.engine.train.loop import train
from segmented_checkpointing.engine.train.optim import learning_rate_at

QUIET = {"log": lambda line: None}


def _config(tmp_path, name, **changes):
    base = TrainConfig.create(output=str(tmp_path / name), resolution=64, steps=20, lr_scheduler="cosine",
                       lr_warmup_steps=3, batch_size=2, lora=LoraSettings(rank=4, alpha=8.0, dropout=0.1),
                       data=str(tmp_path / "data"), timing_warmup_steps=1)
    return base.replace(**changes)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("train")
    write_sample_dataset(root / "data")
    return root


def test_four_plus_resume_plus_four_equals_eight(data_dir):
    """6 images in batches of 2: the stop falls inside the second epoch, the run ends in the third."""
    full, second = full_and_resumed(lambda name, **changes: _config(data_dir, name, steps=8, **changes), 4, **QUIET)
    assert not second.interrupted and second.report["totals"]["steps"] == 8
    a, b = load_file(full.lora_path), load_file(second.lora_path)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6
    assert [h["lr"] for h in full.history] == [h["lr"] for h in second.history]
    assert [h["step"] for h in second.history] == list(range(1, 9))
    assert [h["loss"] for h in full.history] == pytest.approx([h["loss"] for h in second.history], abs=1e-6)
    assert full.history[0]["loss"] != full.history[1]["loss"]


def test_one_seed_gives_one_adapter_whatever_ran_before_in_the_process(data_dir):
    """peft draws lora_A from torch's global generator: a server that ran anything before (or a
    sweep's previous cell) must not change the adapter a seed gives."""
    from segmented_checkpointing.engine.model.bundle import build_preset

    bundle, runs = build_preset("flux"), []  # loaded once (as a server or a sweep does): no reseeding
    for name in ("first", "second"):
        torch.rand(1000)  # anything else drawing from the global generator
        copy_ = dataclasses.replace(bundle, transformer=copy.deepcopy(bundle.transformer))
        runs.append(train(_config(data_dir, name, steps=2), bundle=copy_, **QUIET))
    a, b = (load_file(r.lora_path) for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(train(_config(data_dir, "other-seed", steps=2, seed=7), **QUIET).lora_path)
    lora_a = [k for k in a if k.endswith("lora_A.weight")]
    assert lora_a and not any(torch.equal(other[k], a[k]) for k in lora_a)


def _hand_written_lr(config: TrainConfig, step: int) -> float:
    """The schedule as this project computed it by hand before it used diffusers' factory."""
    lr, warm = config.optimizer.learning_rate, config.optimizer.lr_warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if config.optimizer.lr_scheduler == "constant":
        return lr
    progress = (step - warm) / max(1, config.steps - warm)
    if config.optimizer.lr_scheduler == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_learning_rate_schedule_equals_the_hand_written_one_step_by_step(scheduler, warmup):
    config = TrainConfig.create(steps=12, learning_rate=2e-3, lr_warmup_steps=warmup, lr_scheduler=scheduler)
    assert [learning_rate_at(config.optimizer, config.steps, s) for s in range(12)] == pytest.approx(
        [_hand_written_lr(config, s) for s in range(12)], rel=1e-12, abs=0)


def _resume_warnings(config, saved_steps: int) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_resume_schedule(config, saved_steps, done=4)
    return len(caught)


@pytest.mark.parametrize("schedule", LR_SCHEDULES.values(), ids=lambda s: s.name)
def test_a_schedule_decays_as_declared_and_the_resume_check_reads_the_declaration(schedule):
    """``decays`` is what diffusers' shape does (the rate of the first steps changes with the total
    steps), and a resume to another step count warns exactly then."""
    config = TrainConfig.create(steps=12, learning_rate=2e-3, lr_warmup_steps=2, lr_scheduler=schedule.name)
    rates = {steps: [learning_rate_at(config.optimizer, steps, s) for s in range(12)] for steps in (12, 24)}
    assert (rates[12] != rates[24]) == schedule.decays
    assert (_resume_warnings(config, 24), _resume_warnings(config, 12)) == (int(schedule.decays), 0)


def test_a_schedule_is_one_row_the_rate_and_the_resume_check_both_read(monkeypatch):
    """A row added to ``LR_SCHEDULES`` alone reaches the learning rate (its diffusers shape) and the
    resume check (its ``decays``): no other list of schedule names to extend."""
    row = LRSchedule("cosine_with_restarts", "cosine_with_restarts", decays=True)
    monkeypatch.setitem(LR_SCHEDULES, row.name, row)
    config = SimpleNamespace(optimizer=SimpleNamespace(lr_scheduler=row.name, lr_warmup_steps=0, learning_rate=1.0),
                             steps=8)
    assert learning_rate_at(config.optimizer, 8, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)), abs=1e-12)
    assert _resume_warnings(config, 16) == 1


def test_the_run_uses_that_schedule_with_gradient_accumulation(data_dir):
    config = _config(data_dir, "lr", steps=5, lr_scheduler="cosine", lr_warmup_steps=2,
                     gradient_accumulation_steps=2, batch_size=1)
    result = train(config, **QUIET)
    assert [h["lr"] for h in result.history] == pytest.approx([_hand_written_lr(config, s) for s in range(5)],
                                                              rel=1e-12, abs=0)


def test_lora_file_report_and_inference_mode(data_dir):
    config = _config(data_dir, "small", steps=3, lr_scheduler="constant", lr_warmup_steps=0,
                     gradient_accumulation_steps=2)
    with torch.inference_mode():  # ComfyUI runs nodes like this; training must leave it
        result = train(config, **QUIET)
    tensors = load_file(result.lora_path)
    assert tensors and not any(".default." in k for k in tensors)
    assert all(k.startswith("transformer.") for k in tensors)
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in tensors
    assert not any(k.endswith(".alpha") for k in tensors)  # alpha / rank is folded into lora_B
    with safe_open(str(result.lora_path), "pt") as fh:
        meta = fh.metadata()
    diffusers_config = json.loads(meta["lora_adapter_metadata"])
    assert diffusers_config["transformer.r"] == diffusers_config["transformer.lora_alpha"] == 4
    assert json.loads(meta["lora_settings"])["alpha"] == 8.0
    assert meta["family"] == "flux" and json.loads(meta["schedule"])["gradient_checkpointing_interval"] == 2
    report = json.loads(result.report_path.read_text())
    assert report["plan"]["block_map"] == {"double": "CC..CC..", "single": "CC..CC.."}
    assert report["plan"]["lists"][0]["segments"] == [[0, 2], [4, 6]]
    assert len(report["steps"]) == 3 and report["totals"]["sec_per_step"] > 0
    assert all(s["peak_bytes"] > 0 and s["recomputed_blocks"] == 2 * 8 for s in report["steps"])
    assert all(s["checkpoint_calls"] == 2 * 4 for s in report["steps"])  # 2 micro-batches x 4 segments
