"""What a run's options point at, fingerprinted: the data folder's files and captions, the model
file, ComfyUI's prepared latents. Saved with the resumable state; a resume compares it with the
inputs it finds, so a data folder that gained or lost images (the saved epoch position would
then skip or repeat some) or a model file replaced under the same name by one of another size or
layout is named before any work, not found in the results.

Fingerprints are cheap: file sizes and the SHA-256 of captions and of a safetensors header (it
lists every tensor's name, dtype, shape and byte range; of a GGUF file, its tensor table), never
of the image or weight data; so a file of the same size and header (another fine-tune of the same
model, stored alike) is not told apart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..config import DataConfig, ModelConfig
from ..files.checks import safetensors_header
from ..model.quantized.gguf_file import is_gguf, open_gguf
from .folder import scan_dataset

FIRST = 3
"""How many changed files a message names (then ``... and N more``)."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _file_identity(path: Path) -> dict[str, Any]:
    """A weights file's size and the hash of its header: a safetensors header (read and checked by
    :func:`~..files.checks.safetensors_header`), or a GGUF file's architecture and tensor table
    (:meth:`~..model.quantized.gguf_file.GGUFFile.identity`)."""
    if is_gguf(path):
        header = open_gguf(path, "model_file").identity()
    else:
        header = safetensors_header(path, "model_file", "download or copy the file again")
    return {"name": path.name, "bytes": path.stat().st_size,
            "header_sha": _sha(json.dumps(header, sort_keys=True).encode())}


def _data_files(folder: str) -> dict[str, str]:
    """``{relative image path: "<bytes>:<repeats>:<caption sha>"}`` of every sample the folder holds."""
    root, files = Path(folder), {}
    for sample in scan_dataset(folder).samples:
        try:
            name = sample.image.relative_to(root).as_posix()
        except ValueError:  # a followed link out of the folder
            name = sample.image.as_posix()
        files[name] = f"{sample.image.stat().st_size}:{sample.repeats}:{_sha(sample.caption.encode())}"
    return files


def _prepared(prepared) -> dict[str, Any]:
    """ComfyUI's LATENT + CONDITIONING (``PreparedData.cache``): the hash of every tensor's bytes
    (one batch: small)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(prepared.cache.items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"sha": digest.hexdigest()[:16]}


def input_fingerprint(data: DataConfig, model: ModelConfig, prepared=None) -> dict[str, Any]:
    """The fingerprint of what the ``data`` and ``model`` options (and ``prepared``, ComfyUI's data) point at:
    ``{"data": {path: "<bytes>:<repeats>:<caption sha>"}, "model_file": {...}, "model_path":
    {...}, "prepared": {...}}`` (the keys that apply). Reads file sizes, captions and headers only.

    Raises:
        DatasetError: the data folder cannot be read (see ``engine/data/folder.py``).
        DamagedFileError: ``model_file`` is not a complete safetensors or GGUF file.
        ModelLoadError: a GGUF ``model_file`` holds a tensor type no GGUF version defines.
    """
    found: dict[str, Any] = {}
    if data.folder is not None:
        found["data"] = _data_files(data.folder)
    if model.model_file is not None:
        found["model_file"] = _file_identity(Path(model.model_file))
    if model.model_path is not None:
        folder = Path(model.model_path)
        weights = sorted(p for p in folder.rglob("*.safetensors") if p.is_file())
        configs = sorted(p for p in folder.rglob("config.json") if p.is_file())
        found["model_path"] = {"weights": {p.relative_to(folder).as_posix(): p.stat().st_size for p in weights},
                               "config_sha": _sha(b"".join(p.read_bytes() for p in configs))}
    if prepared is not None:
        found["prepared"] = _prepared(prepared)
    return found


def _names(items: list[str]) -> str:
    more = f" and {len(items) - FIRST} more" if len(items) > FIRST else ""
    return ", ".join(items[:FIRST]) + more


def data_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """What changed between two data fingerprints, in words: ``["2 images added (c.png, d.png)",
    "1 removed (a.png)", "1 image or caption changed (b.png)"]`` (empty: the same data)."""
    added = sorted(set(now) - set(saved))
    removed = sorted(set(saved) - set(now))
    changed = sorted(k for k in set(now) & set(saved) if now[k] != saved[k])
    words = []
    if added:
        words.append(f"{len(added)} image{'s' * (len(added) != 1)} added ({_names(added)})")
    if removed:
        words.append(f"{len(removed)} removed ({_names(removed)})")
    if changed:
        words.append(f"{len(changed)} image or caption changed ({_names(changed)})")
    return words


def input_changes(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(data changes, model changes)`` between the fingerprint saved with a state and the one
    of the inputs now, each in words (see :func:`data_changes`). A state saved before
    fingerprints existed (``saved`` empty) has none to compare."""
    if not saved:
        return [], []
    data = data_changes(saved.get("data", {}), now.get("data", {})) if "data" in saved or "data" in now else []
    if saved.get("prepared") != now.get("prepared"):
        data.append("ComfyUI's LATENT or CONDITIONING differ")
    model = []
    for key in ("model_file", "model_path"):
        before, after = saved.get(key), now.get(key)
        if before != after:
            model.append(f"{key} is not what the saved run trained on ({_describe(before)} then, "
                         f"{_describe(after)} now)")
    return data, model


def _describe(identity: dict[str, Any] | None) -> str:
    if identity is None:
        return "none"
    if "bytes" in identity:
        return f"{identity['name']}: {identity['bytes']} bytes, header {identity['header_sha']}"
    return f"{len(identity['weights'])} weight files, config {identity['config_sha']}"
