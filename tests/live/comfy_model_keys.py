"""ComfyUI's own model for original-layout files: the keys and shapes of the model ComfyUI builds.

Run with ComfyUI's interpreter (``COMFYUI_PYTHON``)::

    python comfy_model_keys.py COMFYUI_PATH OUT_JSON FILE...

For each ``FILE`` (a ``.safetensors`` transformer; only its header is read), detects the model as
ComfyUI's loader does (``model_detection.model_config_from_unet``), builds it on ``meta``
(``get_model``) and writes ``{FILE: {"model": supported-model class, "state": {key: shape}}}`` of
``model.diffusion_model.state_dict()`` to ``OUT_JSON``, and ``"renamed": [...]`` the file's keys as
ComfyUI renames them on load (``process_unet_state_dict``). A file ComfyUI does not detect gets
``{"error": ...}``.
"""

from __future__ import annotations

import json
import sys


def main(comfyui: str, out_file: str, *files: str) -> None:
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_detection
    import torch
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(path, framework="pt") as fh:
            sd = {k: torch.empty(fh.get_slice(k).get_shape(), device="meta") for k in fh.keys()}
        try:
            config = comfy.model_detection.model_config_from_unet(sd, "")
            if config is None:
                raise ValueError("ComfyUI detects no model")
            with torch.device("meta"):
                model = config.get_model(sd, "", device="meta")
            out[path] = {"model": type(config).__name__,
                         "state": {k: list(v.shape) for k, v in model.diffusion_model.state_dict().items()},
                         "renamed": sorted(config.process_unet_state_dict(dict(sd)))}
        except Exception as exc:  # noqa: BLE001 - reported per file
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out_file, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
