"""Quantized model files written as the tools that make users' files write them (shared by
tests/model/test_quantized_files.py and the node tests): ComfyUI's scaled fp8 safetensors and
city96/ComfyUI-GGUF's GGUF files, from a model's state dict in its original layout."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from segmented_checkpointing.engine.families import get_family


def tiny_flux() -> torch.nn.Module:
    """The Flux tiny preset, seed 3."""
    family = get_family("flux")
    torch.manual_seed(3)
    return family.model_cls()(**family.tiny_config).eval()


E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: ComfyUI's scale is a weight's amax over it."""


def _is_linear_weight(key: str, value: torch.Tensor) -> bool:
    return value.ndim == 2 and key.endswith(".weight")


def write_scaled_fp8(path: Path, original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``original`` (BFL keys, fp32) as ComfyUI's scaled fp8 file; returns the dequantized weights (fp32)."""
    tensors, dequantized = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for key, value in original.items():
        if _is_linear_weight(key, value):
            scale = (value.abs().amax() / E4M3_MAX).float()
            weight = (value / scale).to(torch.float8_e4m3fn)
            tensors[key], tensors[key[:-len("weight")] + "scale_weight"] = weight, scale
            dequantized[key] = weight.float() * scale
        else:
            tensors[key] = value.to(torch.bfloat16)
            dequantized[key] = tensors[key].float()
    tensors["double_blocks.0.img_attn.qkv.scale_input"] = torch.tensor(1.0)  # fp8 matmul inputs: ignored
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return dequantized


def write_gguf(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]], arch: str = "flux") -> None:
    """A GGUF file of ``tensors`` (``{name: float array}``, or ``(raw blocks, type)``), as convert.py writes it."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_q8_gguf(path: Path, original: dict[str, torch.Tensor], arch: str = "flux") -> dict[str, torch.Tensor]:
    """``original`` as a Q8_0 GGUF file; returns the dequantized weights (fp32, gguf's reference)."""
    tensors, dequantized = {}, {}
    for key, value in original.items():
        array = value.float().numpy()
        if array.ndim == 2 and array.shape[-1] % 32 == 0:
            blocks = gguf.quants.quantize(array, Q.Q8_0)
            tensors[key] = (blocks, Q.Q8_0)
            dequantized[key] = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0))
        else:
            tensors[key] = array
            dequantized[key] = value.float()
    write_gguf(path, tensors, arch)
    return dequantized


K_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}
"""Byte offsets of the fp16 scales in a K-quant block (ggml's block_q4_K / q5_K: d, dmin first;
block_q6_K: d last; block_q2_K: d, dmin last): filled with finite values, the other bytes random."""


def blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks ``(rows, row bytes)`` of type ``kind``: gguf's own quantization where it has one,
    else random bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    if kind not in K_SCALE_FIELDS:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in K_SCALE_FIELDS[kind]:
        raw[:, offset:offset + 2] = (rng.standard_normal((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)
