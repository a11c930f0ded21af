"""What a LoRA file's header says, read before any model is built: whether a file is a LoRA at
all, the family this pack recorded in it, and its rank (the first dimension of every
``lora_A`` / kohya ``lora_down`` weight). So an ``init_lora`` of another family or rank, or a LoRA
given as the model, is named in one line before the model loads, not in a dict dump after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..files.checks import safetensors_header

DOWN = (".lora_A.weight", ".lora_down.weight")
"""Suffixes of the down-projection weights (peft / diffusers, kohya); shape ``(rank, in_features)``."""


def lora_ranks(header: dict[str, Any]) -> dict[int, int]:
    """``{rank: number of adapted modules}`` of a safetensors header (empty: not a LoRA)."""
    ranks: dict[int, int] = {}
    for name, entry in header.items():
        if name != "__metadata__" and name.endswith(DOWN) and entry.get("shape"):
            ranks[int(entry["shape"][0])] = ranks.get(int(entry["shape"][0]), 0) + 1
    return ranks


def _training_state(path: str | Path, header: dict[str, Any], key: str) -> None:
    """Refuse a resumable training state (it holds LoRA weights too, under ``lora.``) given as
    ``key``: it is continued with ``--resume`` in its output folder.

    Raises:
        ConfigError: ``header`` is a training state's (``step`` and ``data_position`` in it).
    """
    meta = header.get("__metadata__") or {}
    if "step" in meta and "data_position" in meta:
        raise ConfigError(f"{key}={str(path)!r} is invalid: this file is a resumable training state (step "
                          f"{meta['step']}), not a {'model' if key == 'model_file' else 'LoRA'}: continue it with "
                          f"--resume --output {str(Path(path).parent)!r}, or give the lora.safetensors beside it")


def _family(header: dict[str, Any]) -> str | None:
    """The family this pack wrote into a LoRA's header (``save_lora`` writes it as the plain
    string; ``None``: another tool's file)."""
    return (header.get("__metadata__") or {}).get("family") or None


def check_init_lora(path: str | Path, family: str, rank: int) -> None:
    """Check an ``init_lora`` file against the run: a complete safetensors LoRA, of this family
    when its header names one, of the run's ``lora_rank``.

    Raises:
        DamagedFileError: the file is missing, damaged or not a safetensors file.
        ConfigError: no LoRA weights in it; a training state; another family; another rank (both
            named).
    """
    header = safetensors_header(path, "init_lora", "give a complete .safetensors LoRA file")
    _training_state(path, header, "init_lora")
    ranks = lora_ranks(header)
    meta = header.get("__metadata__") or {}
    if ranks and meta.get("lora_format") == "comfyui" and "lora_settings" in meta:
        # fused projections hold the parts' ranks stacked: the trained rank is in the settings
        ranks = {int(json.loads(meta["lora_settings"])["rank"]): sum(ranks.values())}
    tensors = len(header) - ("__metadata__" in header)
    if not ranks:
        raise ConfigError(f"init_lora={str(path)!r} is invalid: allowed a LoRA file; its {tensors} tensors hold no "
                          "lora_A/lora_B (or lora_down/lora_up) weights (a model file?)")
    saved = _family(header)
    if saved is not None and saved != family:
        raise ConfigError(f"init_lora={str(path)!r} is a LoRA of family {saved!r} (its header says so); this run "
                          f"trains {family!r}: allowed a {family} LoRA")
    if set(ranks) != {rank}:
        found = ", ".join(f"rank {r} ({n} modules)" for r, n in sorted(ranks.items()))
        hint = f" (set --rank {next(iter(ranks))} to continue it)" if len(ranks) == 1 else ""
        raise ConfigError(f"init_lora={str(path)!r} has {found}; this run's lora_rank is {rank}: allowed a LoRA of "
                          f"rank {rank}{hint}")


def check_not_a_lora(path: str | Path, header: dict[str, Any], key: str = "model_file") -> None:
    """Refuse a LoRA given where a model is expected.

    Raises:
        ConfigError: ``header`` (a safetensors header) holds LoRA weights, or is a training state's.
    """
    _training_state(path, header, key)
    ranks = lora_ranks(header)
    if ranks:
        modules = sum(ranks.values())
        raise ConfigError(f"{key}={str(path)!r} is invalid: this file is a LoRA ({modules} adapted modules of rank "
                          f"{', '.join(map(str, sorted(ranks)))}), not a model: give it as --init-lora (or load it "
                          f"with ComfyUI's LoRA loader); allowed a model's .safetensors file")
