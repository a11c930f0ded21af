"""What a LoRA file's header says, read before any model is built: whether a file is an adapter
at all (LoRA, DoRA, LoKr, LoHa: :data:`KINDS`, the tensor names peft gives each), the family and
adapter type this pack recorded in it, and its rank (the first dimension of every ``lora_A`` /
kohya ``lora_down`` / ``hada_w1_b`` / decomposed LoKr factor). So an ``init_lora`` of another family,
type or rank, or a LoRA given as the model, is named in one line before the model loads, not in a
dict dump after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..config import ConfigError
from ..files.checks import safetensors_header


@dataclass(frozen=True)
class AdapterKind:
    """One ``lora_type``, as peft names and scales it.

    Attributes:
        name: the ``lora_type``.
        tensors: its tensors' names after ``<module>.`` in peft's state dict.
        scaled: the tensor that takes the scale, in order of preference (the first a module has).
        rank: ``(tensor, dim)`` pairs whose size is the rank, in order of preference (a LoKr whose
            factors are both full matrices has none).
    """

    name: str
    tensors: tuple[str, ...]
    scaled: tuple[str, ...]
    rank: tuple[tuple[str, int], ...]


KINDS = {kind.name: kind for kind in (
    AdapterKind("lora", ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"), ("lora_B.weight",),
                (("lora_A.weight", 0),)),
    AdapterKind("lokr", ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
                ("lokr_w1", "lokr_w1_a"), (("lokr_w2_b", 0), ("lokr_w1_b", 0))),
    AdapterKind("loha", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"), ("hada_w1_a",),
                (("hada_w1_b", 0),)),
)}
"""The adapters by ``lora_type`` (``engine/config/lora.py`` ``LORA_TYPES``)."""

MAGNITUDE = "lora_magnitude_vector"
"""DoRA's magnitude ``m`` ``(out,)``: the norm of each output row of the adapted weight."""


def split_key(key: str) -> tuple[str, str, AdapterKind] | None:
    """``<module>.<tensor>`` -> ``(module, tensor, kind)`` for an adapter tensor of any kind, else None."""
    for kind in KINDS.values():
        for tensor in kind.tensors:
            if key.endswith("." + tensor):
                return key[: -len(tensor) - 1], tensor, kind
    return None


def kind_of(keys: Iterable[str]) -> AdapterKind | None:
    """The kind of the adapter tensors among ``keys`` (the first found), or None."""
    return next((found[2] for found in map(split_key, keys) if found is not None), None)


def modules_of(keys: Iterable[str]) -> list[str]:
    """The adapted modules named by adapter tensor ``keys``, sorted."""
    return sorted({found[0] for found in map(split_key, keys) if found is not None})



KOHYA = ("lora_down.weight", 0)
"""kohya's and ComfyUI's name of a LoRA's down projection ``(rank, in)``."""


def lora_ranks(header: dict[str, Any]) -> dict[int, int]:
    """``{rank: number of adapted modules}`` of a safetensors header (empty: no rank tensor; see
    :func:`adapter_type` for whether it is an adapter at all)."""
    ranked = {t: d for kind in KINDS.values() for t, d in kind.rank} | dict([KOHYA])
    ranks: dict[int, int] = {}
    counted: set[str] = set()
    for name, entry in header.items():
        module, _, tensor = name.rpartition(".")
        if name.endswith(".weight"):
            module, _, tensor = name[: -len(".weight")].rpartition(".")
            tensor += ".weight"
        if name == "__metadata__" or tensor not in ranked or module in counted or not entry.get("shape"):
            continue
        counted.add(module)
        rank = int(entry["shape"][ranked[tensor]])
        ranks[rank] = ranks.get(rank, 0) + 1
    return ranks


def adapter_type(header: dict[str, Any]) -> str | None:
    """The ``lora_type`` of the adapter tensors a safetensors header names (``lora`` for kohya's and
    ComfyUI's ``lora_down`` / ``lora_up`` too), or None: no adapter."""
    found = kind_of(k for k in header if k != "__metadata__")
    if found is not None:
        return found.name
    return "lora" if any(k.endswith("." + KOHYA[0]) for k in header) else None


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


def check_init_lora(path: str | Path, family: str, rank: int, lora_type: str = "lora") -> None:
    """Check an ``init_lora`` file against the run: a complete safetensors adapter, of this family
    when its header names one, of the run's ``lora_type`` and ``lora_rank``.

    Raises:
        DamagedFileError: the file is missing, damaged or not a safetensors file.
        ConfigError: no adapter weights in it; a training state; another family, type or rank
            (each named).
    """
    header = safetensors_header(path, "init_lora", "give a complete .safetensors LoRA file")
    _training_state(path, header, "init_lora")
    ranks, found = lora_ranks(header), adapter_type(header)
    meta = header.get("__metadata__") or {}
    if found and meta.get("lora_format") == "comfyui" and "lora_settings" in meta:
        # fused projections hold the parts' ranks stacked: the trained rank is in the settings
        ranks = {int(json.loads(meta["lora_settings"])["rank"]): max(1, sum(ranks.values()))}
    tensors = len(header) - ("__metadata__" in header)
    if found is None:
        raise ConfigError(f"init_lora={str(path)!r} is invalid: allowed a LoRA file; its {tensors} tensors hold no "
                          "lora_A/lora_B (or lora_down/lora_up, lokr_*, hada_*) weights (a model file?)")
    saved = _family(header)
    if saved is not None and saved != family:
        raise ConfigError(f"init_lora={str(path)!r} is a LoRA of family {saved!r} (its header says so); this run "
                          f"trains {family!r}: allowed a {family} LoRA")
    if found != lora_type:
        raise ConfigError(f"init_lora={str(path)!r} holds a {found} adapter; this run's lora_type is {lora_type!r}: "
                          f"allowed a {lora_type} file, or set lora_type to {found}")
    if ranks and set(ranks) != {rank}:  # a LoKr of full factors names no rank: its shapes are checked on load
        found_ranks = ", ".join(f"rank {r} ({n} modules)" for r, n in sorted(ranks.items()))
        hint = f" (set --rank {next(iter(ranks))} to continue it)" if len(ranks) == 1 else ""
        raise ConfigError(f"init_lora={str(path)!r} has {found_ranks}; this run's lora_rank is {rank}: allowed a "
                          f"LoRA of rank {rank}{hint}")


def check_not_a_lora(path: str | Path, header: dict[str, Any], key: str = "model_file") -> None:
    """Refuse a LoRA given where a model is expected.

    Raises:
        ConfigError: ``header`` (a safetensors header) holds LoRA weights, or is a training state's.
    """
    _training_state(path, header, key)
    ranks = lora_ranks(header)
    if adapter_type(header) is not None:
        modules = max(1, sum(ranks.values()))
        raise ConfigError(f"{key}={str(path)!r} is invalid: this file is a LoRA ({modules} adapted modules of rank "
                          f"{', '.join(map(str, sorted(ranks)))}), not a model: give it as --init-lora (or load it "
                          f"with ComfyUI's LoRA loader); allowed a model's .safetensors file")
