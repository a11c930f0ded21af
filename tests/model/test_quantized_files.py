"""Quantized single files as a frozen base: ComfyUI's scaled fp8 safetensors and city96's GGUF.

The files are written here from the Flux tiny preset in Black Forest Labs' layout, as the tools
that make users' files write them: the scaled fp8 file as ComfyUI saves one (``scaled_fp8`` marker,
e4m3fn weights, per-layer fp32 ``scale_weight = amax / 448``, a ``scale_input`` that a weight-only
base ignores, the rest bf16); the GGUF file as ComfyUI-GGUF's ``tools/convert.py`` writes one
(``gguf.GGUFWriter``, ``general.architecture = flux``, 2-D weights whose last dimension is a
multiple of 32 as Q8_0 through ``gguf.quants.quantize``, the rest F32). Each trains through the
engine's entry point; its first loss is compared with a safetensors file of the same weights
dequantized (exact-ish: the same numbers reach the same matmuls) and with the original fp32
weights (a stated quantization bound).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import random_batch
from original_layouts import TO_ORIGINAL, flux_to_bfl
from quantized_files import blocks, tiny_flux, write_gguf, write_q8_gguf, write_scaled_fp8
from safetensors.torch import load_file, save_file

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.api import load_model
from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.files.checks import DamagedFileError
from segmented_checkpointing.engine.measure.host import streamed_bytes_estimate
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.model.loading import run_precision
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.model.lora_header import check_init_lora
from segmented_checkpointing.engine.model.precision import apply_base_precision
from segmented_checkpointing.engine.model.quantized.gguf_file import LOADED_TYPES, PLAIN
from segmented_checkpointing.engine.model.quantized.gguf_linear import (
    GGUFLinear,
    GGUFWeight,
    assign_weights,
    dequantize,
)
from segmented_checkpointing.engine.train.checks import check_input_paths

pytestmark = pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.model.text_encoders.TextEncoderWarning")
STEPS = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files, a VAE folder and a data folder; ``full_bytes``: the dequantized transformer's fp32 bytes."""
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("quantized")
    model = tiny_flux()
    original = {k: v.contiguous() for k, v in flux_to_bfl(model.state_dict()).items()}
    save_file(original, str(root / "flux.safetensors"))
    save_file(write_scaled_fp8(root / "flux_fp8_scaled.safetensors", original), str(root / "fp8_dequantized.safetensors"))
    save_file(write_q8_gguf(root / "flux-Q8_0.gguf", original), str(root / "q8_dequantized.safetensors"))
    build_preset("flux").vae.save_pretrained(root / "vae")
    write_sample_dataset(root / "data")
    linear = [v for k, v in model.state_dict().items() if v.ndim == 2]
    return {"root": root, "full_bytes": sum(v.numel() * 4 for v in model.state_dict().values()),
            "largest_layer_bytes": max(v.numel() * 4 for v in linear)}


@pytest.fixture(scope="module")
def trained(files):
    """``trained(model_file, name, **changes) -> (report, log lines)``: each run trained once per module."""
    done: dict = {}

    def run(model_file: str, name: str, **changes):
        if name not in done:
            done[name] = _train(files, model_file, name, **changes)
        return done[name]
    return run


def _config(files, model_file: str, name: str, **changes) -> TrainConfig:
    root = files["root"]
    return TrainConfig.create(output=str(root / "runs" / name), model_file=str(root / model_file),
                              vae_path=str(root / "vae"), data=str(root / "data"), resolution=64, steps=STEPS,
                              batch_size=2, family="flux", base_model_precision="fp32", device="cpu",
                              timing_warmup_steps=1, **changes)


def _train(files, model_file: str, name: str, **changes) -> tuple[dict, list[str]]:
    lines: list[str] = []
    api.train(_config(files, model_file, name, **changes), log=lines.append)
    return json.loads((files["root"] / "runs" / name / "report.json").read_text()), lines


def _losses(report: dict) -> list[float]:
    return [s["loss"] for s in report["steps"]]


def _lora_trained(files, name: str) -> bool:
    lora = load_file(str(files["root"] / "runs" / name / "lora.safetensors"))
    return all(torch.isfinite(v).all() for v in lora.values()) and any(
        v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # peft starts B at zero


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------ training from the files

def test_gguf_q8_trains_like_its_dequantized_weights_without_a_full_precision_copy(files, trained):
    gguf_run, lines = trained("flux-Q8_0.gguf", "gguf")
    reference, _ = trained("q8_dequantized.safetensors", "gguf-reference")
    original, _ = trained("flux.safetensors", "original")
    losses = _losses(gguf_run)
    assert all(np.isfinite(losses)) and _lora_trained(files, "gguf")
    assert "stored as GGUF F32/Q8_0 (general.architecture flux)" in lines[0] and "168 Linear layers kept quantized" \
        in lines[0]
    assert any("168/168 Linear layers quantized (GGUF, dequantized per layer)" in line for line in lines)
    # the same dequantized numbers reach the same F.linear: equal up to summation order (measured: bit-equal)
    assert _relative(losses[0], _losses(reference)[0]) <= 1e-5
    # Q8_0 rounds each weight to 1/127 of its 32-block's amax (<= 0.4 % of it); the first loss moves by
    # about that relative amount at most (measured: 5.8e-5)
    assert _relative(losses[0], _losses(original)[0]) <= 4e-3
    # memory: the frozen base stays quantized (Q8_0: 34 bytes per 32 weights; the 1-D tensors F32), and a
    # step holds at most one layer's dequantized weight beyond what the same step over plain weights holds
    # (its fp32 copy and the blocks' fp32 scales, 1/32 of it): never the transformer's 1.79 MB
    first, plain = gguf_run["steps"][0], reference["steps"][0]
    assert first["resident_frozen_bytes"] < 0.3 * files["full_bytes"] == 0.3 * plain["resident_frozen_bytes"]
    assert first["peak_bytes"] - plain["peak_bytes"] <= 1.1 * files["largest_layer_bytes"] < 0.05 * files["full_bytes"]


def test_a_linear_that_lets_autograd_keep_its_dequantized_weight_breaks_that_bound(files, trained, monkeypatch):
    """The bound above tells the two apart: diffusers' own ``GGUFLinear.forward`` (F.linear over the
    dequantized weight under autograd) keeps every plain block's weights alive until backward."""
    def naive(self, x):
        return torch.nn.functional.linear(x, dequantize(self.weight, self.compute_dtype), self.bias)

    monkeypatch.setattr(GGUFLinear, "forward", naive)
    naive_run, _ = _train(files, "flux-Q8_0.gguf", "gguf-naive")
    reference, _ = trained("q8_dequantized.safetensors", "gguf-reference")
    excess = naive_run["steps"][0]["peak_bytes"] - reference["steps"][0]["peak_bytes"]
    assert excess > 10 * files["largest_layer_bytes"]  # measured: 589,824 bytes (18 layers)


def test_scaled_fp8_trains_like_its_dequantized_weights(files, trained):
    fp8_run, lines = trained("flux_fp8_scaled.safetensors", "fp8")
    reference, _ = trained("fp8_dequantized.safetensors", "fp8-reference")
    original, _ = trained("flux.safetensors", "original")
    losses = _losses(fp8_run)
    assert all(np.isfinite(losses)) and _lora_trained(files, "fp8")
    assert "stored as BF16/F8_E4M3, scaled fp8 (112 layers, dequantized as read), loaded as float32" in lines[0]
    assert losses == _losses(reference)  # the same fp32 products fp8 * scale: the same run
    # e4m3 keeps 3 mantissa bits (<= 6.25 % relative per weight) and the other tensors are bf16
    # (<= 0.4 %): the first loss moves by a few percent at most (measured: 2.3e-3)
    assert _relative(losses[0], _losses(original)[0]) <= 5e-2


def test_a_streamed_gguf_base_streams_its_quantized_bytes(files, trained):
    resident, _ = trained("flux-Q8_0.gguf", "gguf")
    streamed, lines = trained("flux-Q8_0.gguf", "gguf-streamed", weight_offload="stream")
    assert _losses(streamed) == _losses(resident)
    assert "SSSSSSSS  weights streamed: 8 of 8" in "\n".join(lines)
    step = streamed["steps"][-1]
    # the host copies are the quantized blocks (plus the F32 norms and biases), as predicted from
    # the file's header before any weight is read
    estimated = _config(files, "flux-Q8_0.gguf", "estimate", weight_offload="stream")
    estimate = streamed_bytes_estimate(estimated.model, estimated.schedule)
    assert step["streamed_frozen_bytes"] == estimate < 0.3 * files["full_bytes"]
    assert step["weight_h2d_bytes"] > 0


# ------------------------------------------------------------------ the pieces, exactly

@pytest.mark.parametrize("kind", [t for t in LOADED_TYPES if t not in PLAIN])
def test_each_loaded_block_type_dequantizes_as_ggufs_reference_and_splits_by_rows(kind):
    kind = Q[kind]
    raw = blocks(kind, 6, 512)
    weight = GGUFWeight(torch.from_numpy(raw.copy()), quant_type=kind)
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    got = dequantize(weight, torch.float32)
    assert got.shape == (6, 512) and torch.equal(got, want)
    # rows are whole blocks: a row split of the raw data (a fused qkv) is exact, and stays quantized
    parts = weight.chunk(3, dim=0)
    assert all(isinstance(p, GGUFWeight) and p.quant_shape == (2, 512) for p in parts)
    assert torch.equal(torch.cat([dequantize(p, torch.float32) for p in parts]), want)
    copied = copy.deepcopy(weight)
    assert copied.quant_type == kind and torch.equal(copied.as_tensor(), weight.as_tensor())


def test_peft_trains_a_lora_over_a_gguf_linear_and_autograd_saves_no_weight():
    """A LoRA over a GGUF layer equals one over a plain Linear holding the dequantized weight (values
    and gradients), and no saved tensor is the layer's weight ``(96, 64)``: the hooks of checkpointing
    and offload see activations only."""
    raw = blocks(Q.Q8_0, 96, 64)
    gguf_layer, plain = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96)
    assign_weights(gguf_layer, {"weight": GGUFWeight(torch.from_numpy(raw), quant_type=Q.Q8_0),
                                "bias": plain.bias.detach().clone()}, torch.float32)
    plain.weight.data = dequantize(gguf_layer.weight, torch.float32)
    models = []
    for layer in (gguf_layer, plain):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("proj", layer)
        add_lora(model, LoraSettings(rank=4, alpha=4, init="gaussian"), ("proj",))
        models.append(model)
    assert type(models[0].proj.base_layer) is GGUFLinear
    results = []
    for model in models:
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            y = model(x)
        (y.square().sum()).backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        results.append((y.detach(), x.grad, grads, saved))
    (y0, gx0, g0, saved0), (y1, gx1, g1, saved1) = results
    assert torch.equal(y0, y1) and torch.allclose(gx0, gx1, rtol=0, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(g0, g1)) and len(g0) == 2
    assert (64, 96) in saved1 and not {(96, 64), (64, 96)} & set(saved0)  # the plain Linear saves W.t()


@pytest.mark.parametrize("family_name, arch, layout", [("sd3", "sd3", "original"), ("qwenimage", "qwen_image", "diffusers")])
def test_gguf_files_of_other_families_load_through_their_conversion(tmp_path, family_name, arch, layout):
    """SD3's original layout goes through diffusers' own conversion, on the quantized tensors; a
    diffusers-layout file (Qwen-Image) needs none: both predict what their dequantized weights do."""
    family = get_family(family_name)
    torch.manual_seed(3)
    model = family.model_cls()(**family.tiny_config).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state = TO_ORIGINAL[family_name](state) if layout == "original" else state
    save_file(write_q8_gguf(tmp_path / "m.gguf", state, arch), str(tmp_path / "dequantized.safetensors"))
    lines = []
    quantized = load_model(TrainConfig.create(family=family_name, model_file=str(tmp_path / "m.gguf"),
                                              base_model_precision="fp32"), log=lines.append).transformer
    plain = load_model(TrainConfig.create(family=family_name, model_file=str(tmp_path / "dequantized.safetensors"),
                                          base_model_precision="fp32"), log=lambda line: None).transformer
    assert f"{family_name}, {layout} layout" in lines[0] and f"(general.architecture {arch})" in lines[0]
    assert any(isinstance(m, GGUFLinear) for m in quantized.modules())
    latents, sigmas, text = random_batch(family, quantized)
    with torch.no_grad():
        got, want = (family.read_output(m, m(**family.make_inputs(m, latents, sigmas, text)), latents)
                     for m in (quantized, plain))
    assert torch.equal(got, want)


def test_scaled_fp8_loads_into_bf16_rounded_once(files):
    bundle = load_model(TrainConfig.create(model_file=str(files["root"] / "flux_fp8_scaled.safetensors"),
                                           base_model_precision="bf16"), log=lambda line: None)
    fp8 = load_file(str(files["root"] / "flux_fp8_scaled.safetensors"))
    want = (fp8["img_in.weight"].float() * fp8["img_in.scale_weight"]).to(torch.bfloat16)
    assert torch.equal(bundle.transformer.x_embedder.weight, want)


def test_scaled_fp8_under_fp8_torchao_is_requantized_within_one_fp8_step(files):
    """torchao's per-row scales re-round the file's per-tensor-scaled values: at most half an e4m3
    step (2**-4 relative) plus half its smallest subnormal (2**-10 of the row scale), not bit-exact."""
    config = TrainConfig.create(model_file=str(files["root"] / "flux_fp8_scaled.safetensors"),
                                base_model_precision="fp8-torchao", device="cpu")
    precision = run_precision(config.model, torch.device("cpu"))
    model = load_model(config, log=lambda line: None).transformer
    base = apply_base_precision(model, precision, torch.device("cpu"))
    assert base.quantized_linear_layers == 168
    fp8 = load_file(str(files["root"] / "flux_fp8_scaled.safetensors"))
    want = fp8["img_in.weight"].float() * fp8["img_in.scale_weight"]
    row_scale = want.abs().amax(dim=1, keepdim=True) / 448
    got = model.x_embedder.weight.dequantize().float()
    assert ((got - want).abs() <= want.abs() * 2**-4 + row_scale * 2**-10).all()


# ------------------------------------------------------------------ refusals, one line each

def _patch_type(path: Path, name: str, type_id: int) -> None:
    """Overwrite the type field of tensor ``name``'s info (name, n_dims u32, dims u64 x n, type u32)."""
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def _refusal(config: TrainConfig) -> str:
    """The message of the pre-checks (``segckpt train`` before any model) and of the loader: the same line."""
    with pytest.raises(ValueError) as checked:
        check_input_paths(config)
    with pytest.raises(ValueError) as loaded:
        load_model(config, log=lambda line: None)
    assert str(checked.value) == str(loaded.value) and "\n" not in str(loaded.value)
    return str(loaded.value)


def test_refused_gguf_files_are_named_in_one_line(files, tmp_path):
    original = {k: v.float().numpy() for k, v in flux_to_bfl(tiny_flux().state_dict()).items()}
    low = tmp_path / "flux-Q2_K.gguf"  # time_in.in_layer.weight (32, 256): one Q2_K block per row
    write_gguf(low, {**original, "time_in.in_layer.weight": (blocks(Q.Q2_K, 32, 256), Q.Q2_K)})
    unknown = tmp_path / "flux-unknown.gguf"
    write_gguf(unknown, original)
    _patch_type(unknown, "img_in.weight", 99)
    llm = tmp_path / "llama-3-8b-Q8_0.gguf"
    write_gguf(llm, {"token_embd.weight": original["img_in.weight"], "blk.0.attn_q.weight":
                     (blocks(Q.Q8_0, 32, 64), Q.Q8_0), "output_norm.weight": np.ones(32, np.float32)}, arch="llama")
    whole = (files["root"] / "flux-Q8_0.gguf").read_bytes()
    cut, head = tmp_path / "cut.gguf", tmp_path / "head.gguf"
    cut.write_bytes(whole[: len(whole) * 9 // 10])
    head.write_bytes(whole[:40])
    wants = {
        low: "holds GGUF type Q2_K (1 tensor, first time_in.in_layer.weight), which is not loaded here: allowed "
             + ", ".join(LOADED_TYPES),
        unknown: "holds a tensor of unknown GGUF type id 99 (not one of gguf ",
        llm: "is a GGUF of architecture 'llama' (general.architecture), not a diffusion transformer",
        cut: "is damaged: truncated or overwritten",
        head: "is damaged: truncated or overwritten",
    }
    for path, want in wants.items():
        text = _refusal(TrainConfig.create(model_file=str(path), base_model_precision="fp32"))
        assert str(path) in text and want in text, text


def test_gguf_option_rules_refuse_before_any_work(files):
    path = str(files["root"] / "flux-Q8_0.gguf")
    with pytest.raises(ConfigError, match=r"base_model_precision='int8-torchao' is invalid with a GGUF model_file"):
        TrainConfig.create(model_file=path, base_model_precision="int8-torchao")
    with pytest.raises(ConfigError, match=r"fsdp=True is invalid with a GGUF model_file .*allowed false"):
        TrainConfig.create(model_file=path, fsdp=True)
    with pytest.raises(DamagedFileError, match=r"init_lora .* is not a safetensors file: .*\(a GGUF file\)"):
        check_init_lora(path, "flux", 4)
    assert api.model_family(None, path) == "flux"
    # no_change: the dtype of the file's unquantized tensors (F32 here), which the quantized ones dequantize to
    no_change = TrainConfig.create(model_file=path, base_model_precision="no_change", device="cpu").model
    assert run_precision(no_change, torch.device("cpu")).storage_dtype == torch.float32
