"""Apply a LoRA file to ComfyUI's own MODEL as ``LoraLoaderModelOnly`` does and write what it changed.

Run by the live tests with ComfyUI's interpreter (``COMFYUI_PYTHON``)::

    python comfy_lora_check.py COMFYUI_PATH MODEL_FILE LORA_FILE OUT_FILE

Loads ``MODEL_FILE`` with ComfyUI's ``load_diffusion_model`` (``UNETLoader``), applies ``LORA_FILE``
at strength 1 with ``load_lora_for_models`` (what ``LoraLoaderModelOnly`` calls), patches the
weights, and writes ``patched - original`` of every weight it changed to ``OUT_FILE`` (safetensors,
fp32, ComfyUI's key names). ComfyUI's log lines (``lora key not loaded: ...``) go to stdout.
"""

from __future__ import annotations

import logging
import sys


def main(comfyui: str, model_file: str, lora_file: str, out_file: str) -> None:
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args

    args.cpu = True
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s", force=True)
    import comfy.sd
    import comfy.utils
    from safetensors.torch import save_file

    model = comfy.sd.load_diffusion_model(model_file)
    before = {k: v.detach().float().clone() for k, v in model.model.diffusion_model.state_dict().items()}
    lora = comfy.utils.load_torch_file(lora_file, safe_load=True)
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)
    patched.patch_model()
    after = patched.model.diffusion_model.state_dict()
    deltas = {k: (after[k].detach().float() - before[k]).contiguous() for k in before}
    save_file({k: v for k, v in deltas.items() if v.abs().max() > 0}, out_file)  # the changed weights only
    print(f"patched {len(patched.patches)} weights from {len(lora)} LoRA tensors")


if __name__ == "__main__":
    main(*sys.argv[1:5])
