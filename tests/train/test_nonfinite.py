"""The non-finite guard: a NaN gradient stops the run naming its LoRA module (or is skipped), no
NaN reaches a file, and the saved last good step resumes to the uninterrupted result."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.train import setup
from segmented_checkpointing.engine.train.nonfinite import (
    FiniteCheck,
    check_finite,
    describe,
)
from segmented_checkpointing.engine.train.state import load_state

TARGET = "transformer_blocks.1.attn.to_k.lora_B.default.weight"


@pytest.fixture
def nan_at_step_2(monkeypatch):
    """Every model that gets a LoRA gets a NaN in one LoRA gradient on its second backward."""
    real = setup.add_lora

    def add_lora_with_a_fault(model, *args, **kwargs):
        params = real(model, *args, **kwargs)
        calls = []

        def poison(grad):
            calls.append(1)
            return grad * float("nan") if len(calls) == 2 else grad

        dict(model.named_parameters())[TARGET].register_hook(poison)
        return params

    monkeypatch.setattr(setup, "add_lora", add_lora_with_a_fault)
    return monkeypatch


def _argv(out, *extra):
    return ["train", "--steps", "4", "--resolution", "64", "--output", str(out), *extra]


def test_a_nan_gradient_stops_the_run_naming_its_module_and_the_last_good_step_resumes(
        nan_at_step_2, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_argv(out)) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("segckpt: error:")]
    assert len(line) == 1 and "Traceback" not in err
    assert "non-finite values at step 2" in line[0]
    assert "first LoRA module with a non-finite gradient: transformer_blocks.1.attn.to_k (lora_B)" in line[0]
    assert "is finite but a LoRA gradient is not" in line[0]
    assert "base_model_precision=fp32 (compute fp32), attention_backend=flash,efficient,math on cpu" in line[0]
    assert "lowering the learning rate will not help" in line[0]
    state = load_state(out)
    assert state.step == 1 and len(state.history) == 1
    files = [*load_file(out / "lora.safetensors").values(), *state.lora.values()]
    files += [t for slots in state.optimizer["state"].values() for t in slots.values()]
    assert all(t.isfinite().all() for t in files)
    report = json.loads((out / "report.json").read_text())
    assert report["stopped"].startswith("non-finite values at step 2") and report["totals"]["steps"] == 1

    # the fault is gone (as after a fix): resuming the saved step gives the uninterrupted result
    nan_at_step_2.undo()
    assert cli.main(_argv(out, "--resume")) == 0
    assert cli.main(_argv(tmp_path / "clean")) == 0
    resumed, clean = load_file(out / "lora.safetensors"), load_file(tmp_path / "clean" / "lora.safetensors")
    assert max((resumed[k] - clean[k]).abs().max().item() for k in clean) <= 1e-6


def test_skip_drops_the_update_of_that_step_and_goes_on(nan_at_step_2, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_argv(out, "--on-nonfinite", "skip")) == 0
    printed = capsys.readouterr().out
    assert "step 2: update skipped: non-finite values at step 2" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["skipped_steps"] == [2] and report["totals"]["steps"] == 4 and report["stopped"] is None
    assert all(t.isfinite().all() for t in load_file(out / "lora.safetensors").values())


def test_check_finite_names_the_first_bad_module_in_one_pass():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.ones(2), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 0])
    named = [("x.lora_A.default.weight", a), ("y.to_q.lora_B.default.weight", b), ("z.lora_A.default.weight", c)]
    check = check_finite(torch.tensor(0.25), named)
    assert (check.loss, check.loss_finite, check.bad_module, check.ok) == (0.25, True, "y.to_q (lora_B)", False)
    b.grad = torch.ones(2)
    assert check_finite(torch.tensor(0.25), named).bad_module == "z (lora_A)"
    c.grad = None
    assert check_finite(torch.tensor(0.25), named).ok
    assert not check_finite(torch.tensor(float("nan")), named).loss_finite


@pytest.mark.parametrize("check, step, changes, advice", [
    (FiniteCheck(0.5, True, "m (lora_A)"), 3, {"device": "cuda:0", "attention_backend": ("cudnn", "flash")},
     "use --attention-backend auto, which leaves cuDNN out"),
    (FiniteCheck(0.5, True, "m (lora_A)"), 3, {"compute": "fp16"}, "fp16 overflowed in backward"),
    (FiniteCheck(float("nan"), False, "m (lora_A)"), 1, {}, "before any update: check the model weights"),
    (FiniteCheck(float("inf"), False, None), 7, {}, "lower the learning rate (now 0.001) or lora_alpha (now 32"),
    (FiniteCheck(float("nan"), False, None), 7, {"compute": "fp16"}, "fp16 overflowed in forward"),
])
def test_advice_fits_the_cause(check, step, changes, advice):
    precision = {"base_model_precision": "bf16", "storage": "bf16", "compute": changes.pop("compute", "bf16")}
    context = {"device": "cpu", "precision": precision, "attention_backend": ("flash", "efficient", "math"),
               "learning_rate": 1e-3, "lora_alpha": 32.0, "lora_rank": 16, **changes}
    assert advice in describe(check, step, context)


def test_a_bad_gradient_is_named_by_its_module_and_adapter_tensor():
    from segmented_checkpointing.engine.train.nonfinite import lora_module_name

    assert lora_module_name("blocks.0.attn.to_k.lora_B.default.weight") == "blocks.0.attn.to_k (lora_B)"
    assert lora_module_name("blocks.0.attn.to_k.lokr_w1_a.default") == "blocks.0.attn.to_k (lokr_w1_a)"
    assert lora_module_name("blocks.0.ff.net.2.hada_w2_b.default") == "blocks.0.ff.net.2 (hada_w2_b)"
    assert lora_module_name("a.to_q.lora_magnitude_vector.default.weight") == "a.to_q (lora_magnitude_vector)"
