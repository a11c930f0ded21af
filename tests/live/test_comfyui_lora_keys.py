"""Live (``COMFYUI_PATH`` set): for each family ComfyUI 0.3.64 builds at a small size, a random-init
file of the released layout loads in ComfyUI's ``load_diffusion_model``, the pack's ``lora_format
comfyui`` file applied by ``load_lora_for_models`` (what ``LoraLoaderModelOnly`` calls) uses every
key (no "lora key not loaded"), and ComfyUI's patched weights differ from the base by exactly the
adapter's update (peft's merge, mapped to the released layout), to 1e-5.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from comfy_models import COMFY_SMALL
from live_comfyui import comfyui_path
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.layouts import get_layout
from segmented_checkpointing.engine.model.lora_files import add_lora, save_lora_files

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="COMFYUI_PATH is not set")


@pytest.mark.parametrize("name", sorted(COMFY_SMALL))
def test_comfyui_applies_every_key_and_exactly_the_update(tmp_path, name):
    family = get_family(name)
    torch.manual_seed(0)
    base = family.model_cls()(**COMFY_SMALL[name]).float().eval()
    model = copy.deepcopy(base)
    add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), family.lora_targets)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.05)
    layout = get_layout(name)
    model_file = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in layout.to_original(base.state_dict()).items()}, str(model_file))
    files = save_lora_files(model, tmp_path / "lora.safetensors", LoraSettings(rank=4, alpha=8), name, "comfyui")
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    merged = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    before, after = layout.to_original(base.state_dict()), layout.to_original(merged)
    expected = {k: after[k] - before[k] for k in before if not torch.equal(after[k], before[k])}
    out = tmp_path / "deltas.safetensors"
    done = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(ROOT / "tests" / "live" / "comfy_lora_check.py"),
                           str(comfyui_path()), str(model_file), str(files["comfyui"]), str(out)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lora key not loaded" not in done.stdout, done.stdout
    got = load_file(str(out))
    assert got.keys() == expected.keys() and expected
    assert max(v.abs().max().item() for v in expected.values()) > 1e-3  # a delta the check can see
    worst = max(((got[k] - expected[k]).abs().max() / expected[k].abs().max()).item() for k in got)
    assert worst <= 1e-5, worst
