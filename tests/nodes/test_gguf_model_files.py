"""The Load Diffusion Model node lists and loads GGUF files from ComfyUI's diffusion_models/ and
unet/ folders (and ComfyUI-GGUF's ``unet_gguf`` folders), never from checkpoints/; inside ComfyUI the
folders come from a stubbed ``folder_paths``, whose own extension filters list no ``.gguf``."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from helpers import verdict
from original_layouts import flux_to_bfl
from quantized_files import tiny_flux, write_q8_gguf

from segmented_checkpointing.engine.model.quantized.gguf_linear import GGUFLinear
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes import environment

NODE = NODES["SegCkptLoadDiffusionModel"]


def _files(models: Path) -> None:
    """GGUF files in unet/, diffusion_models/ (a real tiny Flux Q8_0) and checkpoints/ (not listed)."""
    for folder in ("unet", "diffusion_models/sub", "checkpoints"):
        (models / folder).mkdir(parents=True, exist_ok=True)
    original = {k: v.contiguous() for k, v in flux_to_bfl(tiny_flux().state_dict()).items()}
    write_q8_gguf(models / "diffusion_models" / "sub" / "flux-Q8_0.gguf", original)
    (models / "unet" / "flux-Q4_K_S.gguf").write_bytes(b"GGUF")
    (models / "checkpoints" / "flux-Q8_0.gguf").write_bytes(b"GGUF")
    (models / "unet" / ".hidden.gguf").write_bytes(b"GGUF")


def _stub_comfyui(monkeypatch, base: Path, extra: Path) -> None:
    """ComfyUI 0.3.64's ``folder_paths`` layout (diffusion_models = unet + diffusion_models, filtered
    by ``supported_pt_extensions``, + ``output/diffusion_models``, which ``main.py``'s
    ``apply_custom_paths`` adds) plus ComfyUI-GGUF's ``unet_gguf`` kind: diffusion_models' folders
    and one more."""
    models, output = base / "models", base / "output"
    pt = {".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft"}
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.base_path = str(base)
    folder_paths.folder_names_and_paths = {
        "diffusers": ([str(models / "diffusers")], {"folder"}),
        "diffusion_models": ([str(models / "unet"), str(models / "diffusion_models"), str(output / "diffusion_models")],
                             pt),
        "checkpoints": ([str(models / "checkpoints"), str(output / "checkpoints")], pt),
        "loras": ([str(models / "loras")], pt),
        "unet_gguf": ([str(models / "unet"), str(models / "diffusion_models"), str(output / "diffusion_models"),
                       str(extra)], {".gguf"}),
    }
    folder_paths.get_folder_paths = lambda name: list(folder_paths.folder_names_and_paths[name][0])
    folder_paths.get_input_directory = lambda: str(base / "input")
    folder_paths.get_output_directory = lambda: str(base / "output")
    comfy = types.ModuleType("comfy")
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.processing_interrupted = lambda: False
    comfy.model_management.throw_exception_if_processing_interrupted = lambda: None
    comfy.utils = types.ModuleType("comfy.utils")
    for name, module in {"folder_paths": folder_paths, "comfy": comfy, "comfy.model_management":
                         comfy.model_management, "comfy.utils": comfy.utils}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(environment, "in_comfyui", lambda: True)


@pytest.mark.parametrize("host", ["local", "comfyui"])
def test_the_node_lists_gguf_files_of_diffusion_models_and_unet_and_loads_them(tmp_path, monkeypatch, host):
    _files(tmp_path / "models")
    extra = tmp_path / "elsewhere" / "gguf"
    extra.mkdir(parents=True)
    (extra / "wan-Q5_K_M.gguf").write_bytes(b"GGUF")
    if host == "comfyui":
        _stub_comfyui(monkeypatch, tmp_path, extra)
    else:
        monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    choices = [c for c in NODE.INPUT_TYPES()["required"]["source"][1]["options"] if c.endswith(".gguf")]
    want = ["diffusion_models/flux-Q4_K_S.gguf", "diffusion_models/sub/flux-Q8_0.gguf"]
    assert choices == sorted(want + (["diffusion_models/wan-Q5_K_M.gguf"] if host == "comfyui" else []))
    assert NODE.validate_inputs(source="diffusion_models/sub/flux-Q8_0.gguf") is True
    assert "no such .safetensors file" in verdict(NODE, source="checkpoints/flux-Q8_0.gguf")
    (source,) = NODE.execute("flux", "diffusion_models/sub/flux-Q8_0.gguf", 0, "fp32")
    bundle = source.load()
    assert isinstance(bundle.transformer.transformer_blocks[0].attn.to_q, GGUFLinear)


@pytest.mark.parametrize("linked", [False, True])
def test_a_missing_file_names_each_searched_folder_once(tmp_path, monkeypatch, linked):
    """ComfyUI searches ``output/diffusion_models`` too, and ComfyUI-GGUF's kind repeats
    diffusion_models' folders: the message listed ``models/diffusion_models`` twice. A folder
    linked to another is one folder, searched and listed once."""
    (tmp_path / "models" / "unet").mkdir(parents=True)
    if linked:
        (tmp_path / "models" / "diffusion_models").symlink_to("unet", target_is_directory=True)
    _stub_comfyui(monkeypatch, tmp_path, tmp_path / "elsewhere" / "gguf")
    host = environment.current_host()
    assert [d.name for d in host.model_file_dirs["diffusion_models"]] == (
        ["unet"] + ([] if linked else ["diffusion_models"]) + ["diffusion_models", "gguf"])
    folders = "models/unet, " + ("" if linked else "models/diffusion_models, ") + "output/diffusion_models, elsewhere/gguf"
    assert verdict(NODE, source="diffusion_models/missing.safetensors") == (
        f"source='diffusion_models/missing.safetensors' is invalid: no such .safetensors or .gguf file under {folders}")
    assert verdict(NODE, source="checkpoints/missing.safetensors") == (
        "source='checkpoints/missing.safetensors' is invalid: no such .safetensors file under models/checkpoints, "
        "output/checkpoints")
