"""The optimizers, gradient clipping and caption dropout (issue 35).

* Clipping equals ``torch.nn.utils.clip_grad_norm_`` on the same gradients, bit for bit; a
  non-finite norm leaves the gradients for the non-finite guard to name.
* Each optimizer trains 6 finite steps with clipping and caption dropout on; a run stopped after
  step 3 and resumed equals the uninterrupted one bit for bit (LoRA, losses, gradient norms, the
  dropped captions), its state read back with every unpickler refusing; the dropped captions are
  the seed's draws. AdamW8bit's 8-bit state (torchao's tensor subclass; bitsandbytes' nested slots
  where torchao is missing) round-trips exactly.
* Gradient equality with no checkpointing holds with every caption dropped and every step clipped.
* What cannot run is refused before any model is built, naming the key or the pip command.
"""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from helpers import full_and_resumed, refuse_to_build_models
from safetensors import safe_open
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.samplers import caption_dropout
from segmented_checkpointing.engine.train import state as state_module
from segmented_checkpointing.engine.train.loop import TrainingRun, train
from segmented_checkpointing.engine.train.nonfinite import check_finite
from segmented_checkpointing.engine.train.optim import clip_gradients, clipped

QUIET = {"log": lambda line: None}
OPTIMIZERS = {"adamw": {}, "adafactor": {}, "prodigy": {"learning_rate": 1.0},
              # rank 128: lora_A is 128 x 32 = 4096 values, which torchao stores in 8 bits
              "adamw8bit": {"lora": LoraSettings(rank=128, alpha=128.0)}}
RECIPE = {"caption_dropout": 0.5, "max_grad_norm": 0.05}
"""Half the captions dropped and every step clipped (the tiny model's gradient norms are 0.08 to 0.3)."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("optimizers")
    write_sample_dataset(root / "data")
    return root


def _config(root, name, **changes):
    return TrainConfig.create(**{"output": str(root / name), "data": str(root / "data"), "resolution": 32,
                                 "batch_size": 2, "steps": 6, "timing_warmup_steps": 0, **changes})


def _grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 8), (8,), (3, 3))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


def _check_loss_by_noise_level(report) -> None:
    """``loss_by_noise_level`` counts every sample of the run once, in the bin of its noise level, with the
    mean of their losses; each step's samples' losses average to the step's loss (weighting none)."""
    samples = [(s, x) for h in report["steps"] for s, x in zip(h["noise_levels"], h["sample_losses"], strict=True)]
    assert len(samples) == 12 and all(len(h["noise_levels"]) == 2 for h in report["steps"])
    for h in report["steps"]:
        assert sum(h["sample_losses"]) / 2 == pytest.approx(h["loss"], rel=1e-6)
    counts, edges = np.histogram([s for s, _ in samples], bins=10, range=(0, 1))
    sums, _ = np.histogram([s for s, _ in samples], bins=10, range=(0, 1), weights=[x for _, x in samples])
    section = report["loss_by_noise_level"]
    assert section["samples"] == 12 and [b["count"] for b in section["bins"]] == counts.tolist()
    assert [b["low"] for b in section["bins"]] == pytest.approx(edges[:-1].tolist(), abs=1e-15)
    assert [b["mean_loss"] for b in section["bins"]] == [pytest.approx(t / n, rel=1e-12) if n else None
                                                         for t, n in zip(sums.tolist(), counts.tolist())]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_equals_clip_grad_norm(max_norm):
    ours, theirs = _grads(1), _grads(1)
    norm = clip_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    assert clipped(max_norm, norm.item()) == (max_norm == 0.5) and norm.item() > 0.5
    off = _grads(1)
    assert torch.equal(clip_gradients(off, 0), expected)  # 0: the norm, gradients untouched
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(off, _grads(1)))


def test_a_non_finite_norm_leaves_the_gradients_for_the_guard():
    params = _grads(2)
    params[1].grad[3] = float("nan")
    before = [p.grad.clone() for p in params]
    norm = clip_gradients(params, 0.5)
    assert math.isnan(norm.item()) and not clipped(0.5, norm.item())
    assert torch.equal(params[0].grad, before[0]) and torch.equal(params[2].grad, before[2])
    check = check_finite(torch.tensor(1.0), [(f"p{i}.lora_A.x", p) for i, p in enumerate(params)], grad_norm=norm)
    assert check.bad_module == "p1 (lora_A)" and math.isnan(check.grad_norm)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_resumes_bit_exactly_with_clipping_and_caption_dropout(data_dir, name, monkeypatch):
    def make(folder, **changes):
        return _config(data_dir, f"{name}-{folder}", optimizer=name, **RECIPE, **OPTIMIZERS[name], **changes)

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    loads = state_module.load_state

    def load_without_pickle(folder):  # the resume reads its state with every unpickler refusing
        with monkeypatch.context() as m:
            for target, attr in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
                m.setattr(target, attr, refuse)
            return loads(folder)

    monkeypatch.setattr("segmented_checkpointing.engine.train.loop.load_state", load_without_pickle)
    full, resumed = full_and_resumed(make, 3, **QUIET)
    steps = full.report["steps"]
    assert len(steps) == 6 and all(math.isfinite(s["loss"]) and not s["skipped"] for s in steps)
    assert [s["loss"] for s in resumed.report["steps"]] == [s["loss"] for s in steps]
    assert [s["grad_norm"] for s in resumed.report["steps"]] == [s["grad_norm"] for s in steps]
    a, b = load_file(full.lora_path), load_file(resumed.lora_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # every step clipped; the dropped captions are the seed's draws (2 rows a step)
    assert all(s["clipped"] and s["grad_norm"] > RECIPE["max_grad_norm"] for s in steps)
    draws = [int(caption_dropout(0, step, 0, 2, 0.5).sum()) for step in range(6)]
    assert [s["dropped_captions"] for s in resumed.report["steps"]] == draws and 0 < sum(draws) < 12
    assert full.report["totals"]["dropped_captions"] == sum(draws) and full.report["totals"]["clipped_steps"] == 6
    assert resumed.report["optimizer"]["name"] == name
    recipe = resumed.report["recipe"]  # the recipe counts what the run did; the resumed run's whole history
    assert recipe["clipping"] == {"max_grad_norm": RECIPE["max_grad_norm"], "clipped_steps": 6}
    assert recipe["caption_dropout"] == {"probability": RECIPE["caption_dropout"], "dropped_captions": sum(draws)}
    assert recipe["optimizer"]["name"] == name and recipe["optimizer"]["class"] == resumed.report["optimizer"]["class"]
    assert recipe == full.report["recipe"]
    _check_loss_by_noise_level(full.report)
    assert resumed.report["loss_by_noise_level"] == full.report["loss_by_noise_level"]
    with safe_open(str(resumed.state_path), "pt") as fh:
        header, keys = fh.metadata(), set(fh.keys())
    assert header["optimizer_class"] == resumed.report["optimizer"]["class"]
    if name == "adamw8bit":  # its 8-bit moments went through the file as codes, scales and maps
        assert any(k.endswith(".exp_avg.codes") for k in keys) and any(k.endswith(".exp_avg_sq.scale") for k in keys)
        assert full.report["memory"]["optimizer_state_bytes"] < full.report["memory"]["lora_bytes"]


def test_prodigy_state_holds_its_numbers_in_the_header(tmp_path):
    """Prodigy's step count is an int and its estimate lives in the param groups: both round-trip
    as they were (a number, not a tensor), so the resumed update is the same."""
    from prodigyopt import Prodigy

    from segmented_checkpointing.engine.train.state import TrainingState, load_state, save_state

    params = _grads(3)
    optimizer = Prodigy(params, lr=1.0)
    optimizer.step()
    saved = optimizer.state_dict()
    save_state(TrainingState(1, {}, {}, saved, {}), tmp_path)
    loaded = load_state(tmp_path).optimizer
    assert loaded["state"][0]["step"] == 1 and type(loaded["state"][0]["step"]) is int
    assert loaded["param_groups"][0]["d"] == saved["param_groups"][0]["d"]
    assert loaded["param_groups"][0]["growth_rate"] == math.inf
    assert all(torch.equal(loaded["state"][0][k], saved["state"][0][k]) for k in ("s", "p0", "exp_avg"))


def test_bitsandbytes_adamw8bit_where_torchao_is_missing_resumes_bit_exactly(tmp_path, monkeypatch):
    """bitsandbytes' AdamW8bit (not in the test extra: skipped without it) keeps its 8-bit slots in a
    nested dict whose quantization maps share memory; they round-trip through the state exactly."""
    pytest.importorskip("bitsandbytes")
    import importlib.util

    from segmented_checkpointing.engine.config import OptimizerConfig
    from segmented_checkpointing.engine.train.optim import load_optimizer_state, make_optimizer, optimizer_class
    from segmented_checkpointing.engine.train.state import TrainingState, load_state, save_state

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))

    def steps(optimizer, params, first, last):
        for step in range(first, last):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()

    config = OptimizerConfig(name="adamw8bit")
    shapes = ((64, 256), (32, 128), (8,))  # two 8-bit slots sharing their maps, one fp32
    whole = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
    optimizer = make_optimizer(whole, config)
    assert optimizer_class(optimizer) == "bitsandbytes.optim.adamw.AdamW8bit"
    steps(optimizer, whole, 0, 6)
    part = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
    first = make_optimizer(part, config)
    steps(first, part, 0, 3)
    save_state(TrainingState(3, {}, {}, first.state_dict(), {}), tmp_path)
    second = make_optimizer(part, config)
    load_optimizer_state(second, load_state(tmp_path).optimizer)
    steps(second, part, 3, 6)
    assert all(torch.equal(a, b) for a, b in zip(whole, part))
    assert second.state[part[0]]["state1"].dtype == torch.uint8


def test_gradients_equal_no_checkpointing_with_every_caption_dropped_and_every_step_clipped(data_dir):
    """The options act on the inputs (the empty caption's conditioning) and on the gradients after
    backward: every schedule and backend still trains what no checkpointing trains."""
    recipe = {"caption_dropout": 1.0, "max_grad_norm": 0.05, "steps": 1, "batch_size": 2}
    schedules = {"none": {"gradient_checkpointing": False},
                 "interval2-stride4": {"gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4},
                 **{backend: {"gradient_checkpointing_interval": 1, "gradient_checkpointing_backend": backend}
                    for backend in ("torch", "torch-ffn", "unsloth", "unsloth-ffn")}}
    results = {name: train(_config(data_dir, f"equal-{name}", **recipe, **keys), **QUIET)
               for name, keys in schedules.items()}
    reference = results.pop("none")
    step = reference.report["steps"][0]
    assert step["dropped_captions"] == 2 and step["clipped"]
    lora = load_file(reference.lora_path)
    for name, result in results.items():
        assert result.report["steps"][0]["grad_norm"] == step["grad_norm"], name
        assert result.report["steps"][0]["recomputed_blocks"] + result.report["steps"][0]["recomputed_ffn"] > 0, name
        other = load_file(result.lora_path)
        assert all(torch.equal(other[k], lora[k]) for k in lora), name


def test_dropped_captions_train_on_the_empty_caption(data_dir):
    """With every caption dropped, the step's loss is that of a run whose captions are all empty."""
    empty = data_dir / "empty"
    empty.mkdir()
    for image in sorted((data_dir / "data").iterdir()):
        if image.suffix != ".txt":
            (empty / image.name).write_bytes(image.read_bytes())
            (empty / image.with_suffix(".txt").name).write_text("")
    dropped = train(_config(data_dir, "dropped", caption_dropout=1.0, steps=1), **QUIET)
    blank = train(_config(data_dir, "blank", steps=1).replace(data=str(empty)), **QUIET)
    assert dropped.report["steps"][0]["loss"] == blank.report["steps"][0]["loss"]
    assert dropped.report["steps"][0]["dropped_captions"] == 2 and blank.report["steps"][0]["dropped_captions"] == 0


@pytest.mark.parametrize("changes, message", [
    ({"optimizer": "prodigy", "fsdp": True}, r"^optimizer='prodigy' is invalid: allowed adamw with fsdp"),
    ({"max_grad_norm": -1}, r"^max_grad_norm=-1 is invalid: allowed a finite number > 0 and <= 1e\+06, or 0 \(off\)"),
    ({"caption_dropout": 1.5}, r"^caption_dropout=1.5 is invalid: allowed a finite number from 0 to 1"),
    ({"optimizer": "lion"}, r"^optimizer='lion' is invalid: allowed adamw, adamw8bit, adafactor, prodigy"),
])
def test_options_that_cannot_run_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.create(**changes)


def test_a_missing_optimizer_package_is_named_with_its_pip_command_before_any_model(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    refuse_to_build_models(monkeypatch, "the optimizer's package was checked")
    with pytest.raises(ConfigError, match=r"^optimizer='prodigy' needs prodigyopt \(pip install prodigyopt\), which "
                                          r"is not installed here; allowed adamw, adafactor without it\.$"):
        TrainingRun(TrainConfig.create(optimizer="prodigy", output=str(tmp_path / "o")))


def test_prodigy_below_its_learning_rate_convention_warns():
    from segmented_checkpointing.engine.config import ConfigWarning, OptimizerConfig
    from segmented_checkpointing.engine.train.optim import make_optimizer

    with pytest.warns(ConfigWarning, match=r"optimizer=prodigy with learning_rate=0.001: .* advise 1.0 \(--lr 1\)"):
        make_optimizer(_grads(4), OptimizerConfig(name="prodigy"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # at its convention it says nothing
        optimizer = make_optimizer(_grads(4), OptimizerConfig(name="prodigy", learning_rate=1.0))
    assert type(optimizer).__name__ == "Prodigy" and optimizer.param_groups[0]["lr"] == 1.0


def test_caption_dropout_on_prepared_data_is_refused(tmp_path):
    from segmented_checkpointing.engine.data.precheck import precheck

    with pytest.raises(ConfigError, match=r"^caption_dropout=0.1 is invalid with prepared data \(ComfyUI "
                                          r"conditioning\): allowed 0"):
        precheck(TrainConfig.create(caption_dropout=0.1, output=str(tmp_path / "o")), prepared=True)
