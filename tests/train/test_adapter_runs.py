"""LoKr, LoHa and DoRA runs (issue 35): a run stopped after 2 of 3 steps and resumed saves the adapter
of the uninterrupted run; its two files hold one update; either file starts another run's adapter
at the same weights (``init_lora``)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import full_and_resumed
from safetensors import safe_open
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.model.lora_files import add_lora, load_lora_file, lora_state_dict

QUIET = {"log": lambda line: None}
ADAPTERS = {"lokr": {"lora_type": "lokr"}, "loha": {"lora_type": "loha"}, "dora": {"use_dora": True}}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("adapters")
    write_sample_dataset(root / "data")
    return root


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_resumed_run_equals_the_full_one_and_both_files_start_the_same_adapter(data_dir, adapter):
    def config(name, **changes):
        return TrainConfig.create(family="wan", output=str(data_dir / adapter / name), data=str(data_dir / "data"),
                                  resolution=32, steps=3, batch_size=2, lora_rank=4, lora_alpha=8,
                                  gradient_checkpointing_interval=2, **ADAPTERS[adapter], **changes)

    full, resumed = full_and_resumed(config, 2, **QUIET)
    a, b = load_file(full.lora_path), load_file(resumed.lora_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-exact
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]
    with safe_open(str(full.lora_path.with_name("lora_comfyui.safetensors")), "pt") as fh:
        assert fh.metadata()["comfyui_names"] == "released"  # Wan's released q, k, v are separate weights
    bundle = build_preset("wan")
    settings = config("x").lora
    states = []
    for name in ("lora.safetensors", "lora_comfyui.safetensors"):
        model = copy.deepcopy(bundle.transformer)
        add_lora(model, settings, bundle.family.lora_targets, bundle.family)
        if adapter == "dora" and name.endswith("comfyui.safetensors"):
            with pytest.raises(ValueError, match="ComfyUI-format DoRA file is not read back here"):
                load_lora_file(model, full.lora_path.with_name(name), settings, "wan")
            continue
        assert load_lora_file(model, full.lora_path.with_name(name), settings, "wan") > 0
        states.append(lora_state_dict(model))
    moved = {k for k, v in states[0].items() if v.abs().sum() > 0}
    assert moved and all(torch.allclose(s[k], states[0][k], rtol=0, atol=1e-7) for s in states for k in states[0])
