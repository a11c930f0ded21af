"""GGUF model files: city96/ComfyUI-GGUF's format for diffusion transformers, read offline.

A GGUF file (llama.cpp's ``ggml`` container, read with the ``gguf`` package's ``GGUFReader``)
holds key-value metadata and named tensors. ComfyUI-GGUF (``tools/convert.py``, ``loader.py``)
writes a transformer's original-layout keys (``double_blocks.0.img_attn.qkv.weight``; a
``model.diffusion_model.`` prefix is stripped as in safetensors files), ``general.architecture``
(``flux``, ``sd3``, ``wan``, ...), the 2-D weights quantized (Q8_0, K-quants, ...) and the small
tensors in F32/F16; a tensor reshaped to be quantizable carries its torch shape in
``comfy.gguf.orig_shape.<name>``. GGUF stores dimensions innermost first (ggml's ``ne`` order):
the torch shape is the reverse.

Block types (``gguf.GGML_QUANT_SIZES``: ``block`` values in ``type_size`` bytes) run along the
last torch dimension (a row of a weight is whole blocks), so the row splits and concatenations
of a layout conversion (Flux's fused ``qkv``) are exact on the raw data.

The transformer's quantized tensors are read as :class:`~.gguf_linear.GGUFWeight` (``uint8``, the
file's bytes) and the others cast to the run's storage dtype as they are read, one tensor at a
time; nothing is dequantized here except a reshaped tensor (``orig_shape``), which cannot stay in
blocks.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ...files.checks import GGUF_MAGIC, DamagedFileError, is_gguf  # noqa: F401 (is_gguf: the loaders read it here)
from ..bundle import ModelLoadError
from .gguf_linear import GGUFWeight, dequantize

PREFIX = "model.diffusion_model."
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""Unquantized GGUF types (the names are also safetensors' dtype names)."""
LOADED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0")
"""Tensor types loaded: the unquantized ones and the block types of 4 bits and more that
ComfyUI-GGUF's published diffusion models use; each block type's dequantization (diffusers') is
checked against ``gguf``'s reference in tests/model/test_quantized_files.py. Refused: the 2- and
3-bit K-quants and i-quants, ternary and fp4 types (not checked here)."""
DIFFUSION_ARCHITECTURES = ("flux", "sd1", "sdxl", "sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan",
                           "lumina2", "qwen_image", "chroma")
"""``general.architecture`` values of diffusion models (ComfyUI-GGUF's ``IMG_ARCH_LIST``, and
``chroma``); absent or ``pig`` (stable-diffusion.cpp files): the tensor names decide."""
ORIG_SHAPE = "comfy.gguf.orig_shape."


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file (nothing read).

    Attributes:
        name: its name in the file. type_name: ``Q8_0``, ``F32``, ... shape: the torch shape
        (``orig_shape`` when the file records one). nbytes: bytes in the file. index: its index
        in the reader.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    nbytes: int
    index: int
    reshaped: bool = False


@dataclass
class GGUFFile:
    """An opened GGUF file: its architecture and tensors (their data is memory-mapped, not read)."""

    path: Path
    architecture: str | None
    tensors: dict[str, GGUFTensor]
    reader: Any

    def header(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{name: (type name, torch shape)}``, as :func:`~..single_file.read_header` gives it."""
        return {k: (t.type_name, t.shape) for k, t in self.tensors.items()}

    def identity(self) -> dict[str, Any]:
        """What tells this file from another of the same size: its architecture and every tensor's
        name, type, shape and byte range (the tensor data is not hashed)."""
        return {"architecture": self.architecture,
                "tensors": {k: [t.type_name, list(t.shape), self.reader.tensors[t.index].data_offset, t.nbytes]
                            for k, t in sorted(self.tensors.items())}}


def _string_field(reader: Any, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None or len(field.types) != 1 or field.types[0] != gguf.GGUFValueType.STRING:
        return None
    return str(bytes(field.parts[field.data[-1]]), encoding="utf-8")


def _orig_shape(reader: Any, name: str) -> tuple[int, ...] | None:
    field = reader.get_field(ORIG_SHAPE + name)
    if field is None:
        return None
    return tuple(int(field.parts[i][0]) for i in field.data)


def open_gguf(path: str | Path, what: str = "model file") -> GGUFFile:
    """The tensors and architecture of a complete GGUF file (the data is memory-mapped, not read).

    Raises:
        DamagedFileError: missing; not a GGUF file; truncated (a tensor ends past the file's end,
            or the reader cannot read the header or a tensor's data). One line naming the file.
        ModelLoadError: a tensor type id no GGUF version defines (named, with the loaded types).
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedFileError(f"{what} {str(path)!r} does not exist")
    size = path.stat().st_size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown:
            raise ModelLoadError(f"{what} {str(path)!r} holds a tensor of unknown GGUF type id {unknown.group(1)} "
                                 f"(not one of gguf {version('gguf')}'s types): allowed {', '.join(LOADED_TYPES)}"
                                 ) from exc
        reason = "not a GGUF file" if not _has_magic(path) else f"truncated or overwritten, the reader stops at: {exc}"
        raise DamagedFileError(f"{what} {str(path)!r} is damaged: {reason} ({size} bytes); download or copy the "
                               "file again") from exc
    tensors = {}
    for index, t in enumerate(reader.tensors):
        end = t.data_offset + t.n_bytes
        if end > size or t.data.nbytes != t.n_bytes:
            raise DamagedFileError(f"{what} {str(path)!r} is damaged: tensor {t.name!r} ends at byte {end}, past the "
                                   f"file's {size} bytes (truncated); download or copy the file again")
        orig = _orig_shape(reader, t.name)
        shape = orig or tuple(int(v) for v in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, int(t.n_bytes), index, orig is not None)
    return GGUFFile(path, _string_field(reader, "general.architecture"), tensors, reader)


def _has_magic(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def check_transformer(file: GGUFFile, part: dict[str, str]) -> None:
    """Refuse a GGUF whose architecture is not a diffusion model's, or whose transformer tensors
    (``part``: ``{key: name in the file}``) are of a type not loaded here.

    Raises:
        ModelLoadError: one line naming the file and the architecture, or the type, how many
            tensors have it, the first of them and :data:`LOADED_TYPES`.
    """
    arch = file.architecture
    if arch is not None and arch != "pig" and arch not in DIFFUSION_ARCHITECTURES:
        raise ModelLoadError(f"model file {str(file.path)!r} is a GGUF of architecture {arch!r} (general.architecture), "
                             f"not a diffusion transformer (diffusion GGUF architectures: "
                             f"{', '.join(DIFFUSION_ARCHITECTURES)})")
    refused: dict[str, list[str]] = {}
    for name in part.values():
        type_name = file.tensors[name].type_name
        if type_name not in LOADED_TYPES:
            refused.setdefault(type_name, []).append(name)
    if refused:
        kind, names = next(iter(refused.items()))
        raise ModelLoadError(f"model file {str(file.path)!r} holds GGUF type {kind} ({len(names)} tensor{'s' * (len(names) > 1)}, first "
                             f"{names[0]}), which is not loaded here: allowed {', '.join(LOADED_TYPES)} (use a file "
                             "of one of those types)")


def read_tensor(file: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of ``file``: a block type as a :class:`GGUFWeight` (the file's bytes, ``uint8``
    ``(rows, row bytes)``), an unquantized one cast to ``dtype``, a reshaped one dequantized to
    ``dtype`` in its ``orig_shape``. Reads (copies) this tensor's bytes only."""
    info = file.tensors[name]
    raw = file.reader.tensors[info.index]
    data = torch.from_numpy(np.array(raw.data))  # a copy: the memory map stays read-only
    if info.type_name in ("F32", "F16"):
        return data.reshape(info.shape).to(dtype)
    if info.type_name == "BF16":
        return data.view(torch.uint8).view(torch.bfloat16).reshape(info.shape).to(dtype)
    weight = GGUFWeight(data, quant_type=raw.tensor_type)
    if info.reshaped:
        return dequantize(weight, dtype).reshape(info.shape)
    return weight

