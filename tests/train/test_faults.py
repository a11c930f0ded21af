"""Faults a run meets: damaged files end in one line before any model is built (or are rebuilt),
a recompute that takes another path stops naming the block, a loop that rewrites a shared dict
between blocks falls back or stays exact, a resume that changes a decaying schedule says so."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers import MODES, random_batch, refuse_to_build_models
from safetensors.torch import load_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import ConfigWarning, LoraConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.core.plan import ScheduleWarning, count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.data.folder import DataWarning
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.lora_files import add_lora, load_lora_file
from segmented_checkpointing.engine.train import loop as training
from segmented_checkpointing.engine.train import setup
from segmented_checkpointing.engine.train.checks import check_run
from segmented_checkpointing.engine.train.state import load_state


@pytest.fixture
def no_model(monkeypatch):
    refuse_to_build_models(monkeypatch, "the damaged file was reported")


def _short(out, *extra):
    return ["train", "--steps", "2", "--resolution", "32", "--output", str(out), *extra]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("segckpt: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    assert cli.main(_short(out)) == 0
    return out


@pytest.mark.parametrize("damage", ["half", "empty"])
def test_a_damaged_state_ends_in_one_line_before_any_model(finished_run, tmp_path, capsys, no_model, damage):
    out = tmp_path / "copy"
    out.mkdir()
    data = (finished_run / "training_state.safetensors").read_bytes()
    (out / "training_state.safetensors").write_bytes(data[: len(data) // 2] if damage == "half" else b"")
    assert cli.main(_short(out, "--resume", "--steps", "3")) == 2
    line = _one_line(capsys)
    assert "the training state" in line and "training_state.safetensors" in line and "is damaged" in line
    assert "--overwrite" in line


def test_a_damaged_init_lora_ends_in_one_line(finished_run, tmp_path, capsys, no_model):
    data = (finished_run / "lora.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    assert cli.main(_short(tmp_path / "out", "--init-lora", str(tmp_path / "cut.safetensors"))) == 2
    line = _one_line(capsys)
    assert "init_lora" in line and "cut.safetensors" in line and "truncated or overwritten" in line


def _relabelled(lora, path, family):
    """A copy of ``lora`` whose header names another family (as a LoRA trained for it would)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(lora), "pt") as fh:
        save_file({k: fh.get_tensor(k) for k in fh.keys()}, path, {**fh.metadata(), "family": family})
    return path


@pytest.mark.parametrize("case", ["text as model", "text as lora", "lora as model", "other rank", "other family",
                                  "state as model", "state as lora"])
def test_a_wrong_file_is_named_for_what_it_is_before_any_model(finished_run, tmp_path, capsys, no_model, case):
    """A text file is "not a safetensors file" (not "truncated"); a LoRA given as the model is
    "a LoRA"; an init_lora of another rank or family names both."""
    text = tmp_path / "notes.safetensors"
    text.write_text("these are my training notes, not weights\n")
    lora, state = finished_run / "lora.safetensors", finished_run / "training_state.safetensors"
    argv = {"text as model": ["--model-file", str(text), "--vae-path", str(tmp_path)],
            "text as lora": ["--init-lora", str(text)],
            "lora as model": ["--model-file", str(lora), "--vae-path", str(tmp_path)],
            "other rank": ["--init-lora", str(lora), "--rank", "4"],
            "other family": ["--init-lora", str(_relabelled(lora, tmp_path / "sd3.safetensors", "sd3"))],
            "state as model": ["--model-file", str(state), "--vae-path", str(tmp_path)],
            "state as lora": ["--init-lora", str(state)]}[case]
    assert cli.main(_short(tmp_path / "out", *argv)) == 2
    line = _one_line(capsys)
    rank = LoraSettings().rank  # the finished run's
    expected = {
        "text as model": f"model_file {str(text)!r} is not a safetensors file: it begins with b'these are' (a text file)",
        "text as lora": f"init_lora {str(text)!r} is not a safetensors file: it begins with b'these are' (a text file)",
        "lora as model": f"model_file={str(lora)!r} is invalid: this file is a LoRA (",
        "other rank": f"has rank {rank} (",
        "other family": "is a LoRA of family 'sd3' (its header says so); this run trains 'flux': allowed a flux LoRA",
        "state as model": f"model_file={str(state)!r} is invalid: this file is a resumable training state (step 2), "
                          f"not a model: continue it with --resume --output {str(finished_run)!r}",
        "state as lora": f"init_lora={str(state)!r} is invalid: this file is a resumable training state (step 2), "
                         "not a LoRA",
    }[case]
    assert expected in line, line
    if case == "other rank":
        assert f"this run's lora_rank is 4: allowed a LoRA of rank 4 (set --rank {rank} to continue it)" in line


def test_a_damaged_config_ends_in_one_line(tmp_path, capsys, no_model):
    (tmp_path / "c.json").write_text('{"max_train_steps": 3,')
    assert cli.main(["train", "--config", str(tmp_path / "c.json"), "--output", str(tmp_path / "o")]) == 2
    assert "c.json" in _one_line(capsys)


def test_damaged_model_weights_end_in_one_line(tmp_path, capsys):
    from segmented_checkpointing.engine.model.bundle import build_preset

    bundle = build_preset("sd3")
    bundle.transformer.save_pretrained(tmp_path / "m" / "transformer")
    bundle.vae.save_pretrained(tmp_path / "m" / "vae")
    (tmp_path / "m" / "model_index.json").write_text("{}")
    weights = next((tmp_path / "m" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    assert cli.main(_short(tmp_path / "out", "--model-path", str(tmp_path / "m"))) == 2
    line = _one_line(capsys)
    assert "model weights" in line and weights.name in line and "is damaged" in line


def test_a_damaged_cache_is_rebuilt_with_a_warning(finished_run, tmp_path):
    import shutil

    out = tmp_path / "again"
    shutil.copytree(finished_run, out)
    cache = next((out / "cache").glob("cache-*.safetensors"))
    cache.write_bytes(cache.read_bytes()[:500])
    config = TrainConfig.create(steps=1, resolution=32, output=str(out), overwrite=True)
    with pytest.warns(DataWarning, match=f"the latent cache {cache.name} is damaged"):
        training.train(config, log=lambda line: None)
    assert load_file(cache)["latents"].shape[0] == 6  # written again, whole


def test_init_lora_keeps_the_files_update_whatever_the_runs_alpha(finished_run):
    family = get_family("flux")
    saved = load_file(finished_run / "lora.safetensors")
    for alpha in (16.0, 4.0):
        torch.manual_seed(0)
        model = family.model_cls()(**family.tiny_config)
        settings = LoraSettings(rank=16, alpha=alpha)
        add_lora(model, settings, family.lora_targets)
        assert load_lora_file(model, finished_run / "lora.safetensors", settings) > 0
        params = dict(model.named_parameters())
        key = "transformer_blocks.0.attn.to_q.lora_{}.default.weight"
        assert torch.equal(params[key.format("A")], saved["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"])
        assert torch.allclose(params[key.format("B")] * (alpha / 16),
                              saved["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"], atol=1e-7)
    with pytest.raises(LoraConfigError, match="has rank 16 .* set lora_rank to 16"):
        torch.manual_seed(0)
        model = family.model_cls()(**family.tiny_config)
        add_lora(model, LoraSettings(rank=4, alpha=4.0), family.lora_targets)
        load_lora_file(model, finished_run / "lora.safetensors", LoraSettings(rank=4, alpha=4.0))


@pytest.fixture
def recompute_differs_at_step_2(monkeypatch):
    """Block 1's FFN takes another path in its second recompute (step 2): its output has other
    strides, as a branch on free memory or a flag would produce."""
    real = setup.add_lora

    def add_lora_with_a_branch(model, *args, **kwargs):
        params = real(model, *args, **kwargs)
        calls = []

        def branch(module, inputs, output):
            calls.append(1)
            if len(calls) == 4:  # step 1: forward, recompute; step 2: forward, recompute
                return torch.cat([output, output]).sin().asin()[: output.shape[0]]
            return output

        model.transformer_blocks[1].ff.register_forward_hook(branch)
        return params

    monkeypatch.setattr(setup, "add_lora", add_lora_with_a_branch)
    return monkeypatch


def test_a_recompute_that_takes_another_path_stops_naming_the_block(recompute_differs_at_step_2, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_short(out, "--steps", "3")) == 2
    line = _one_line(capsys)
    assert "step 2: the recompute of flux block list 'double', blocks 0-1 (last entered: 1)" in line
    assert "was not deterministic" in line and "gradient_checkpointing false" in line and "torch-ffn" in line
    state = load_state(out)
    assert state.step == 1
    recompute_differs_at_step_2.undo()
    assert cli.main(_short(out, "--steps", "3", "--resume")) == 0
    assert json.loads((out / "report.json").read_text())["totals"]["steps"] == 3


def _flux2_kv(schedule, mode: str):
    """LoRA gradients and output of a tiny Flux.2 in KV-cache mode, with the attention processors
    diffusers' Flux2KleinKVPipeline sets (``_set_kv_attn_processors``)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

    family = get_family("flux2")
    torch.manual_seed(0)
    model = family.model_cls()(**family.tiny_config)
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), family.lora_targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    latents, sigmas, text = random_batch(family, model, batch=1)
    inputs = family.make_inputs(model, latents, sigmas, text)
    reference = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    ref_ids = inputs["img_ids"].clone()
    ref_ids[:, 0] = 1  # the reference image's tokens: t = 1
    if mode == "cached":
        with torch.no_grad():
            _, cache = model(**{**inputs, "hidden_states": torch.cat([reference, inputs["hidden_states"]], 1),
                                "img_ids": torch.cat([ref_ids, inputs["img_ids"]]), "kv_cache_mode": "extract",
                                "num_ref_tokens": reference.shape[1]})
        inputs = {**inputs, "kv_cache": cache, "kv_cache_mode": "cached"}
    else:
        inputs = {**inputs, "hidden_states": torch.cat([reference, inputs["hidden_states"]], 1),
                  "img_ids": torch.cat([ref_ids, inputs["img_ids"]]), "kv_cache_mode": "extract",
                  "num_ref_tokens": reference.shape[1]}
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    runner = SegmentRunner(model, family, plan).install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = runner.forward(**inputs)[0]
    output.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    fell_back = [w for w in caught if issubclass(w.category, ScheduleWarning)]
    return output.detach(), grads, fell_back


@pytest.mark.parametrize("kv_mode", ["cached", "extract"])
@pytest.mark.parametrize("mode", ["layer", "interval2", "interval2-stride4"])
def test_a_loop_that_rewrites_a_shared_dict_falls_back_or_stays_exact(kv_mode, mode):
    out0, grads0, _ = _flux2_kv(MODES["none"], kv_mode)
    out, grads, fell_back = _flux2_kv(MODES[mode], kv_mode)
    assert torch.allclose(out, out0, atol=1e-6, rtol=0)
    worst = max((grads[k] - grads0[k]).abs().max().item() for k in grads0)
    assert worst <= 1e-6, (kv_mode, mode, worst)
    if mode != "layer":  # grouped: the runner sees the per-block kv_cache entry change and says so
        assert fell_back and "fell back to per-block checkpointing" in str(fell_back[0].message)


def test_resume_that_changes_a_decaying_schedule_says_so(tmp_path):
    out = tmp_path / "cosine"
    assert cli.main(_short(out, "--lr-scheduler", "cosine")) == 0
    same = TrainConfig.create(steps=2, resolution=32, output=str(out), resume=True, lr_scheduler="cosine")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_run(same)
    longer = TrainConfig.create(steps=4, resolution=32, output=str(out), resume=True, lr_scheduler="cosine")
    with pytest.warns(ConfigWarning, match="steps=4 differs from the saved run's 2, and lr_scheduler=cosine"):
        check_run(longer)
