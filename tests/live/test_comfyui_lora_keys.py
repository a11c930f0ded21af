"""Live (``COMFYUI_PATH`` set): for each family ComfyUI 0.3.64 builds at a small size, a random-init
file of the released layout loads in ComfyUI's ``load_diffusion_model``, the pack's ``lora_format
comfyui`` file applied by ``load_lora_for_models`` (what ``LoraLoaderModelOnly`` calls) uses every
key (no "lora key not loaded"), and ComfyUI's patched weights differ from the base by exactly the
adapter's update (peft's merge, mapped to the released layout), to 1e-5: for a LoRA on the attention
projections, and for DoRA, LoKr and LoHa on every Linear of the blocks (issue 35; a LoKr the
ComfyUI file cannot hold is refused, named).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from comfy_models import CLOSED_LOOP_FLUX, COMFY_SMALL
from live_comfyui import comfyui_path
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.layouts import LayoutError, get_layout
from segmented_checkpointing.engine.model.lora_files import add_lora, save_lora_files

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="COMFYUI_PATH is not set")


ADAPTERS = {
    "lora": LoraSettings(rank=4, alpha=8, init="gaussian"),
    "dora": LoraSettings(rank=4, alpha=8, init="gaussian", use_dora=True, target_modules="all-linear"),
    "lokr": LoraSettings(rank=2, alpha=8, lora_type="lokr", target_modules="all-linear"),
    "lokr_full": LoraSettings(lora_type="lokr", full_matrix=True, factor=4, target_modules="all-linear"),
    "loha": LoraSettings(rank=2, alpha=6, lora_type="loha", target_modules="all-linear"),
}


SMALL = {**COMFY_SMALL, "flux": CLOSED_LOOP_FLUX}
"""With Flux.1 at its released width (one block of each kind, 2 GB in fp32): a LoKr on its fused q, k, v goes in
the diffusers names ComfyUI maps for Flux."""


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("name", sorted(SMALL))
def test_comfyui_applies_every_key_and_exactly_the_update(tmp_path, name, adapter):
    family, settings = get_family(name), ADAPTERS[adapter]
    torch.manual_seed(0)
    base = family.model_cls()(**SMALL[name]).float().eval()
    model = copy.deepcopy(base)
    add_lora(model, settings, family.lora_targets, family)
    std = 0.3 if adapter == "loha" else 0.05  # a LoHa's update is a product of four: of a size fp32 keeps in W + dW
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.requires_grad:  # every tensor drawn (DoRA's magnitude moved off the base's norms)
                p.mul_(1.1) if "magnitude" in key else p.normal_(0, std)
    layout = get_layout(name)
    model_file = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in layout.to_original(base.state_dict()).items()}, str(model_file))
    try:
        files = save_lora_files(model, tmp_path / "lora.safetensors", settings, name, "comfyui")
    except LayoutError as exc:
        assert adapter.startswith("lokr") and "allowed lora_format=diffusers" in str(exc)
        pytest.skip(f"refused, as it should be: {exc}")
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    merged = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
              if not any(f".{p}_" in k for p in ("lora", "lokr", "hada"))}
    before, after = layout.to_original(base.state_dict()), layout.to_original(merged)
    expected = {k: after[k] - before[k] for k in before if not torch.equal(after[k], before[k])}
    out = tmp_path / "deltas.safetensors"
    done = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(ROOT / "tests" / "live" / "comfy_lora_check.py"),
                           str(comfyui_path()), str(model_file), str(files["comfyui"]), str(out)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lora key not loaded" not in done.stdout and "ERROR" not in done.stdout, done.stdout
    got = load_file(str(out))
    assert got.keys() == expected.keys() and expected
    assert max(v.abs().max().item() for v in expected.values()) > 1e-3  # a delta the check can see
    worst = max(((got[k] - expected[k]).abs().max() / expected[k].abs().max()).item() for k in got)
    largest = max((got[k] - expected[k]).abs().max().item() for k in got)
    print(f"{name} {adapter}: {len(got)} weights, worst difference {largest:.2e} ({worst:.2e} of the largest update)")
    assert worst <= 1e-5, worst
