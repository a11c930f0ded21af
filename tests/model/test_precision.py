"""Base precision (bf16 / fp16 / int8 / fp8 / no_change): what is stored, what trains, what the
report says; checkpointing and offload on a quantized base give the unquantized schedules' values."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers import random_batch
from safetensors.torch import load_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.model.folders import load_model_folder, stored_dtype
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.model.precision import (
    PrecisionError,
    QuantizedLinear,
    apply_base_precision,
    resolve_precision,
)
from segmented_checkpointing.engine.train.loop import train

pytest.importorskip("torchao")
QUIET = {"log": lambda line: None}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
I2S4 = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
SCHEDULES = {"none": CheckpointSchedule(gradient_checkpointing=False), "interval2-stride4": I2S4,
             "unsloth": CheckpointSchedule(gradient_checkpointing_backend="unsloth"),
             "unsloth-ffn+attn": CheckpointSchedule(gradient_checkpointing_backend="unsloth-ffn",
                                                    gradient_checkpointing_offload_attention=True)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("precision") / "data")


def _config(tmp_path, name, data_dir, **changes):
    values = {"output": str(tmp_path / name), "resolution": 64, "steps": 3, "data": str(data_dir),
              "lora": LoraSettings(rank=4, alpha=8.0), "timing_warmup_steps": 1}
    return TrainConfig.create(**{**values, **changes})


def test_resolution_rules():
    assert resolve_precision("auto", "auto", CPU).to_dict() == {"base_model_precision": "fp32", "storage": "fp32",
                                                                "compute": "fp32"}
    assert resolve_precision("auto", "auto", CUDA).to_dict() == {"base_model_precision": "bf16", "storage": "bf16",
                                                                 "compute": "bf16"}
    assert resolve_precision("fp16", "auto", CUDA).compute_dtype == torch.float16
    assert resolve_precision("fp16", "auto", CUDA).loss_scaling
    assert resolve_precision("bf16", "auto", CPU).compute_dtype == torch.bfloat16  # autocast over a bf16 base
    int8 = resolve_precision("int8-torchao", "auto", CUDA)
    assert (int8.quantized, int8.storage_dtype, int8.compute_dtype) == (True, torch.bfloat16, torch.bfloat16)
    assert resolve_precision("int8-torchao", "auto", CPU).storage_dtype == torch.float32
    assert resolve_precision("no_change", "auto", CPU, stored_dtype=torch.bfloat16).storage_dtype == torch.bfloat16
    with pytest.raises(PrecisionError, match="mixed_precision=fp32 is invalid with base_model_precision='fp16'"):
        resolve_precision("fp16", "fp32", CPU)
    with pytest.raises(PrecisionError, match="allowed for no_change: bf16, fp16 or fp32"):
        resolve_precision("no_change", "auto", CPU, stored_dtype=torch.float8_e4m3fn)


def test_fp8_is_refused_on_a_cuda_device_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(PrecisionError, match=r"fp8-torchao is invalid on NVIDIA A100.*capability 8\.0.*int8-torchao"):
        resolve_precision("fp8-torchao", "auto", CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_precision("fp8-torchao", "auto", CUDA).quantized


def test_bf16_base_trains_with_fp32_lora_and_half_the_frozen_bytes(tmp_path, data_dir):
    runs = {p: train(_config(tmp_path, p, data_dir, base_model_precision=p), **QUIET) for p in ("fp32", "bf16")}
    bf16 = runs["bf16"]
    linears = [m for m in bf16.model.modules() if type(m) is torch.nn.Linear]
    base = [m.weight for n, m in bf16.model.named_modules() if type(m) is torch.nn.Linear and "lora_" not in n]
    lora = [p for n, p in bf16.model.named_parameters() if "lora_" in n]
    assert base and all(w.dtype == torch.bfloat16 for w in base)
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    assert len(linears) > len(base)  # LoRA A/B are Linear modules too, kept fp32
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in bf16.history)
    memory = {p: r.report["memory"] for p, r in runs.items()}
    assert memory["bf16"]["frozen_weight_bytes"] * 2 == memory["fp32"]["frozen_weight_bytes"] > 0
    assert memory["bf16"]["lora_bytes"] == memory["fp32"]["lora_bytes"] > 0
    assert memory["bf16"]["optimizer_state_bytes"] == 2 * memory["bf16"]["lora_bytes"] + 4 * len(lora)  # AdamW: 2 moments + an fp32 step
    assert 0 < memory["bf16"]["activation_peak_bytes"] < memory["fp32"]["activation_peak_bytes"]
    assert bf16.report["precision"] == {"base_model_precision": "bf16", "storage": "bf16", "compute": "bf16",
                                        "linear_layers": len(base), "quantized_linear_layers": 0}
    assert all(t.dtype == torch.float32 for t in load_file(bf16.lora_path).values())


def test_cli_base_precision_bf16_three_steps(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", "--base-precision", "bf16", "--steps", "3", "--resolution", "64",
                     "--output", str(out)]) == 0
    assert "base: bf16" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["precision"]["storage"] == "bf16" and len(report["steps"]) == 3
    assert all(isinstance(s["loss"], float) and s["loss"] == s["loss"] for s in report["steps"])


def test_int8_base_counts_its_quantized_layers_and_every_schedule_gives_the_same_losses(tmp_path, data_dir):
    results = {name: train(_config(tmp_path, name, data_dir, base_model_precision="int8-torchao", schedule=s),
                           **QUIET) for name, s in list(SCHEDULES.items())[:3]}
    report = results["none"].report
    quantized = [m for m in results["none"].model.modules() if isinstance(m, QuantizedLinear)]
    assert report["precision"]["quantized_linear_layers"] == len(quantized) == report["precision"]["linear_layers"] > 0
    fp32 = train(_config(tmp_path, "fp32", data_dir), **QUIET).report
    assert report["memory"]["frozen_weight_bytes"] < fp32["memory"]["frozen_weight_bytes"] / 2
    reference = [h["loss"] for h in results["none"].history]
    reference_lora = load_file(results["none"].lora_path)
    for name in ("interval2-stride4", "unsloth"):
        assert [h["loss"] for h in results[name].history] == pytest.approx(reference, abs=1e-6), name
        lora = load_file(results[name].lora_path)
        assert max((lora[k] - reference_lora[k]).abs().max().item() for k in lora) <= 1e-6, name
    assert all(h["recomputed_blocks"] > 0 for h in results["interval2-stride4"].history)


def _grads_on_quantized_base(base_model_precision: str, schedule: CheckpointSchedule, family_name="flux"):
    family = get_family(family_name)
    torch.manual_seed(0)
    model = family.model_cls()(**family.tiny_config)
    layers = apply_base_precision(model, resolve_precision(base_model_precision, "auto", CPU), CPU)
    add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), family.lora_targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    latents, sigmas, text = random_batch(family, model)
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    runner = SegmentRunner(model, family, plan).install()
    output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
    loss = (family.read_output(model, output, latents).float() - latents).pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, runner, layers, model


@pytest.mark.parametrize("base", ["int8-torchao", "fp8-torchao"])
def test_lora_gradients_on_a_quantized_base_equal_no_checkpointing(base):
    loss0, reference, _, layers, model = _grads_on_quantized_base(base, SCHEDULES["none"])
    assert layers.quantized_linear_layers == layers.linear_layers > 0
    # LoRA layers are never quantized: their A/B are plain fp32 Linear weights
    lora_modules = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert lora_modules and all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter
                                and m.weight.dtype == torch.float32 for m in lora_modules)
    for name in ("interval2-stride4", "unsloth", "unsloth-ffn+attn"):
        loss, grads, runner, _, _ = _grads_on_quantized_base(base, SCHEDULES[name])
        assert loss == pytest.approx(loss0, abs=1e-6), name
        worst = max(((grads[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-12)).item()
                    for k in reference)
        assert worst <= 1e-6, (name, worst)


def test_offload_copies_activations_only_never_quantized_weights():
    """The same schedule offloads exactly the same bytes over an fp32 and an int8 base: nothing of
    a weight (quantized data, scales, or a dequantized copy) is ever copied to the host."""
    schedule = SCHEDULES["unsloth-ffn+attn"]
    offloaded = {}
    for base in ("fp32", "int8-torchao"):
        _, _, runner, _, _ = _grads_on_quantized_base(base, schedule)
        offloaded[base] = (runner.offloader.stats.tensors, runner.offloader.stats.bytes)
    assert offloaded["fp32"] == offloaded["int8-torchao"] and offloaded["fp32"][0] > 0


def test_a_quantized_linear_saves_nothing_for_backward():
    layer = torch.nn.Linear(32, 48)
    apply_base_precision(layer, resolve_precision("int8-torchao", "auto", CPU), CPU)
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(5, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    assert saved == []  # torchao's own linear would save the dequantized (48, 32) weight here
    expected = torch.ones(5, 48) @ layer.weight.dequantize()
    assert torch.allclose(x.grad, expected, atol=1e-6)


def test_no_change_keeps_the_stored_dtype_of_a_folder(tmp_path):
    bundle = build_preset("sd3")
    bundle.transformer.to(torch.bfloat16).save_pretrained(tmp_path / "m" / "transformer")
    bundle.vae.save_pretrained(tmp_path / "m" / "vae")
    (tmp_path / "m" / "model_index.json").write_text("{}")
    assert stored_dtype(tmp_path / "m") == torch.bfloat16
    loaded = load_model_folder(tmp_path / "m", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.transformer.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.vae.parameters()} == {torch.float32}


def test_keep_in_fp32_modules_stay_fp32_and_unquantized():
    family = get_family("wan")
    torch.manual_seed(0)
    model = family.model_cls()(**family.tiny_config)
    keep = type(model)._keep_in_fp32_modules
    apply_base_precision(model, resolve_precision("int8-torchao", "bf16", CPU), CPU)
    kept = [(n, m) for n, m in model.named_modules() if any(k in n.split(".") for k in keep)]
    assert kept
    for name, module in kept:
        for p in module.parameters(recurse=False):
            assert p.dtype == torch.float32 and not isinstance(module, QuantizedLinear), name
    others = [m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert others and all(m.weight.dtype == torch.bfloat16 for m in others)


def test_quantizing_a_copy_leaves_the_loaded_model_as_it_was(tmp_path, data_dir):
    """A node or a sweep trains deep copies of one loaded model: the copy is quantized, the
    shared original is not."""
    bundle = build_preset("flux")
    first = dataclasses.replace(bundle, transformer=copy.deepcopy(bundle.transformer))
    result = train(_config(tmp_path, "a", data_dir, base_model_precision="int8-torchao", steps=2), bundle=first,
                   **QUIET)
    assert not any(isinstance(m, QuantizedLinear) for m in bundle.transformer.modules())
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)


def test_fp16_loss_scaling_resumes_exactly(tmp_path, data_dir):
    """fp16 compute runs with a GradScaler; its scale is part of the resumable state."""
    config = _config(tmp_path, "full", data_dir, base_model_precision="fp16", steps=3)
    full = train(config, **QUIET)
    assert full.report["precision"]["compute"] == "fp16"
    stop = iter(range(1, 10))
    first = train(config.replace(output=str(tmp_path / "split")), should_stop=lambda: next(stop) == 1,
                  **QUIET)
    assert first.interrupted
    from segmented_checkpointing.engine.train.state import load_state
    assert load_state(tmp_path / "split").grad_scaler["scale"] > 0
    second = train(config.replace(output=str(tmp_path / "split"), resume=True), **QUIET)
    a, b = load_file(full.lora_path), load_file(second.lora_path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torch_norm_dtype_warnings_do_not_reach_the_user(tmp_path, data_dir):
    import warnings

    bundle = build_preset("flux")
    bundle.transformer.norm_out.register_forward_hook(lambda *a: warnings.warn(
        "Mismatch dtype between input and weight: input dtype = c10::BFloat16, weight dtype = float"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(_config(tmp_path, "w", data_dir, steps=1, base_model_precision="bf16"), bundle=bundle, **QUIET)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)]
