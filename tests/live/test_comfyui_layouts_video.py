"""Against a real ComfyUI (``COMFYUI_PATH``, ``COMFYUI_PYTHON``; skipped without): the released
layouts of HunyuanVideo, LTX-Video, Cosmos Predict 2 and Wan VACE are the names and shapes of the
models ComfyUI itself builds from such files.

At the ``SMALL`` configs of ``tests/model/test_layouts_video.py`` (the widths ComfyUI's detection
assumes), a file written by ``to_original`` is detected by ComfyUI, and its model's state dict has
exactly the file's keys and shapes, which ComfyUI's load-time renames leave as they are; a
HunyuanVideo file in Tencent's names is renamed by ComfyUI into exactly those keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from live_comfyui import ROOT, comfyui_path
from safetensors.torch import save_file

from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.layouts import get_layout
from segmented_checkpointing.engine.model.layouts.hunyuanvideo import hunyuanvideo_to_released

sys.path.insert(0, str(ROOT / "tests" / "model"))
from test_layouts_video import FAMILIES, SMALL  # noqa: E402


def test_released_layouts_are_comfyuis_models(tmp_path):
    checkout = comfyui_path()
    files, written = {}, {}
    for name in FAMILIES:
        family = get_family(name)
        with torch.device("meta"):
            model = family.model_cls().from_config({**family.tiny_config, **SMALL[name]})
        state = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
        layouts = {name: get_layout(name).to_original(state)}
        if name == "hunyuanvideo":
            layouts["hunyuanvideo-tencent"] = hunyuanvideo_to_released(state)
        for label, tensors in layouts.items():
            files[label] = tmp_path / f"{label}.safetensors"
            written[label] = {k: list(v.shape) for k, v in tensors.items()}
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(files[label]))
    out = tmp_path / "comfy.json"
    done = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable),
                           str(ROOT / "tests" / "live" / "comfy_model_keys.py"), str(checkout), str(out),
                           *map(str, files.values())], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    for label, path in files.items():
        result = found[str(path)]
        assert "error" not in result, (label, result)
        family = label.removesuffix("-tencent")
        assert result["state"] == written[family], label
        assert result["renamed"] == sorted(written[family]), label
