"""ComfyUI's scaled fp8 safetensors files (``*_fp8_scaled.safetensors``), dequantized as they are read.

The format, as ComfyUI reads and writes it (``comfy/model_detection.py`` ``model_config_from_unet``,
``comfy/model_base.py`` ``state_dict_for_saving``, ``comfy/ops.py`` ``scaled_fp8_ops``):

- a marker tensor ``scaled_fp8`` (after the ``model.diffusion_model.`` prefix): empty, or of two
  elements, in the fp8 dtype of the weights (``float8_e4m3fn`` or ``float8_e5m2``);
- per scaled Linear, ``<layer>.weight`` in that fp8 dtype and ``<layer>.scale_weight``, an fp32
  scalar ``()`` (or ``(1,)``): the layer's weight is ``weight.to(dtype) * scale_weight``;
- optionally ``<layer>.scale_input`` (fp32 scalars for fp8 matmuls of the activations): not used
  by a weight-only base, consumed and ignored;
- every other tensor as in any file (bf16/fp16 norms, biases, unscaled weights).

Each scaled weight is dequantized to the run's storage dtype as it is read: computed in fp32
(the product of an fp8 value and an fp32 scale, rounded once; exact when the scale is a power of
two) and rounded once more to bf16/fp16 (ComfyUI multiplies in the compute dtype instead). With
``base_model_precision=fp8-torchao`` torchao then requantizes the dequantized weight with its own
per-row scales: fp8 again, but not bit-exact to the file (a per-tensor-scaled value rounded once
more to the per-row grid, at most one e4m3 step, 2**-4 relative).
"""

from __future__ import annotations

import torch

MARKER = "scaled_fp8"
SCALE_WEIGHT = ".scale_weight"
SCALE_INPUT = ".scale_input"


def is_scaled_fp8(keys) -> bool:
    """Whether transformer keys (the prefix stripped) are ComfyUI's scaled fp8 format."""
    return any(k == MARKER or k.endswith(SCALE_WEIGHT) for k in keys)


def split_scales(part: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(weights, scales)`` of a scaled fp8 transformer part (``{key: key in the file}``).

    ``weights``: the part without the marker and the ``scale_weight``/``scale_input`` keys (what
    the model is built from); ``scales``: ``{weight key: its scale_weight key in the file}``.
    """
    weights, scales = {}, {}
    for key, full in part.items():
        if key == MARKER or key.endswith(SCALE_INPUT):
            continue
        if key.endswith(SCALE_WEIGHT):
            scales[key[: -len(SCALE_WEIGHT)] + ".weight"] = full
        else:
            weights[key] = full
    return weights, {k: v for k, v in scales.items() if k in weights}


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight (out, in)`` fp8 times its scalar ``scale`` (fp32), computed in fp32, as ``dtype``."""
    return (weight.to(torch.float32) * scale.to(torch.float32).reshape(())).to(dtype)
