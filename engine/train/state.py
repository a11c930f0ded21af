"""Resumable training state: one ``.safetensors`` file, written atomically.

It holds the LoRA weights, the optimizer's state, the RNG states (global CPU, CUDA, and the
trainer's noise generator) as tensors, and, in the header, the step, the data position, the
per-step history and the config. Nothing is pickled, so loading a state file cannot run code.

The optimizer's state is written slot by slot (:func:`pack_optimizer_state`): a tensor as itself;
an 8-bit state tensor (torchao's ``OptimState8bit``, a tensor subclass) as its inner tensors (codes,
scales, quantization map) with its attributes in the header, rebuilt only for the classes of
:data:`SUBCLASSES`; a number (Prodigy's step count) in the header; a nested dict (bitsandbytes'
slots) slot by slot. The header's ``optimizer_layout`` says which is which, so the round trip is
bit-exact for every optimizer of ``engine/train/optim.py``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.outputs import STATE_FILE
from ..families.lazy import lazy_imports
from ..files.checks import DamagedFileError, check_safetensors
from ..files.tensors import atomic_save_file


@dataclass
class TrainingState:
    """What a resumed run needs to continue bit-for-bit.

    Attributes:
        step: optimizer steps done.
        data_position: the sampler's ``{"epoch", "index"}``.
        lora: bare peft LoRA weights.
        optimizer: ``optimizer.state_dict()`` (its slots and param-group settings; full tensors).
        rng: ``{"cpu": ..., "noise": ..., "cuda.<i>": ...}`` uint8 RNG state tensors.
        history: per-step records so far.
        config: the run's config as a dict (for the report; not used to override options).
        grad_scaler: ``torch.amp.GradScaler.state_dict()`` of fp16 loss scaling (empty otherwise).
        inputs: the fingerprint of the data and model the run trained on
            (``engine/data/fingerprint.py``; empty in states saved before it existed).
    """

    step: int
    data_position: dict[str, int]
    lora: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    grad_scaler: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    optimizer_class: str = ""
    """The optimizer's class (``engine/train/optim.py`` ``optimizer_class``; empty in older states)."""


SUBCLASSES = {"torchao.optim.subclass_8bit.OptimState8bit"}
"""The tensor subclasses an optimizer state may hold that :func:`unpack_optimizer_state` rebuilds
(by ``__tensor_unflatten__`` from their inner tensors); a state naming another class is refused."""


def save_state(state: TrainingState, folder: str | Path) -> Path:
    """Write ``state`` to ``folder/training_state.safetensors`` atomically.

    Raises:
        TypeError: the optimizer's state holds a value that cannot be written without pickling.
    """
    tensors = {f"lora.{k}": v.contiguous() for k, v in state.lora.items()}
    tensors.update({f"rng.{k}": v.contiguous() for k, v in state.rng.items()})
    optimizer, layout = pack_optimizer_state(state.optimizer)
    tensors.update(optimizer)
    header = {
        "step": str(state.step),
        "data_position": json.dumps(state.data_position),
        "param_groups": json.dumps([{k: _number(v) for k, v in group.items()}
                                    for group in state.optimizer["param_groups"]]),
        "optimizer_layout": json.dumps(layout),
        "optimizer_class": state.optimizer_class,
        "history": json.dumps(state.history),
        "config": json.dumps(state.config, default=str),
        "grad_scaler": json.dumps(state.grad_scaler),
        "inputs": json.dumps(state.inputs, separators=(",", ":"), sort_keys=True),
    }
    return atomic_save_file(tensors, Path(folder) / STATE_FILE, header)


def _number(value: Any) -> Any:
    """A param-group setting as JSON holds it: a 0-d tensor (torchao's learning rate) as its number."""
    return value.item() if isinstance(value, torch.Tensor) else value


def pack_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer.state_dict()["state"]``'s slots as safetensors tensors (``optim.<index>.<slot>``)
    and the layout that reads them back (see the module docstring).

    Returns:
        ``(tensors, layout)``: ``layout[index][slot]`` is ``{"tensor": key}``, ``{"value": v}``,
        ``{"dict": {...}}`` or ``{"subclass": class, "inner": {name: key}, "attrs": [...]}``.

    Raises:
        TypeError: a slot holds a value that cannot be written without pickling.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    layout = {str(index): {name: _pack(f"optim.{index}.{name}", value, tensors, seen) for name, value in slots.items()}
              for index, slots in state["state"].items()}
    return tensors, layout


def _put(key: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor], seen: set[int]) -> str:
    """Store ``tensor`` under ``key``: on the CPU, contiguous, copied where a stored tensor shares its
    memory (``seen``: their storages; bitsandbytes' slots share one quantization map, and safetensors
    refuses shared memory)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.untyped_storage().data_ptr() in seen:
        tensor = tensor.clone()
    seen.add(tensor.untyped_storage().data_ptr())
    tensors[key] = tensor
    return key


def _pack(key: str, value: Any, tensors: dict[str, torch.Tensor], seen: set[int]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
        names, attrs = value.__tensor_flatten__()
        return {"subclass": f"{type(value).__module__}.{type(value).__qualname__}",
                "inner": {name: _put(f"{key}.{name}", getattr(value, name), tensors, seen) for name in names},
                "attrs": [{"dtype": str(a).removeprefix("torch.")} if isinstance(a, torch.dtype) else a for a in attrs]}
    if isinstance(value, torch.Tensor):
        return {"tensor": _put(key, value, tensors, seen)}
    if isinstance(value, dict):
        return {"dict": {name: _pack(f"{key}.{name}", v, tensors, seen) for name, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"the optimizer state's {key} is a {type(value).__name__}, which the resumable state cannot "
                    "hold without pickling")


def unpack_optimizer_state(layout: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, Any]]:
    """The optimizer's ``state`` from what :func:`pack_optimizer_state` wrote.

    Raises:
        DamagedFileError: the layout names a tensor the file lacks, or a tensor class not in
            :data:`SUBCLASSES`.
    """
    return {int(index): {name: _unpack(entry, tensors) for name, entry in slots.items()}
            for index, slots in layout.items()}


def _unpack(entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    try:
        if "value" in entry:
            return entry["value"]
        if "tensor" in entry:
            return tensors[entry["tensor"]]
        if "dict" in entry:
            return {name: _unpack(e, tensors) for name, e in entry["dict"].items()}
        if entry["subclass"] not in SUBCLASSES:
            raise DamagedFileError(f"the training state's optimizer holds a {entry['subclass']}, which is not read "
                                   f"here (allowed: {', '.join(sorted(SUBCLASSES))}); {DAMAGED_ADVICE}")
        module, _, name = entry["subclass"].rpartition(".")
        with lazy_imports():
            cls = getattr(importlib.import_module(module), name)
        attrs = [getattr(torch, a["dtype"]) if isinstance(a, dict) else a for a in entry["attrs"]]
        return cls.__tensor_unflatten__({n: tensors[k] for n, k in entry["inner"].items()}, attrs, None, None)
    except KeyError as exc:
        raise DamagedFileError(f"the training state's optimizer layout names {exc}, which the file lacks; "
                               f"{DAMAGED_ADVICE}") from exc


DAMAGED_ADVICE = ("the run cannot continue from it: restore a copy of the output folder, or start over "
                  "with --overwrite (in the node: resume off, and a new run)")


def read_state_header(folder: str | Path) -> dict[str, Any]:
    """The saved ``step``, ``config``, ``data_position`` and ``inputs`` (fingerprint; ``{}`` in an
    older state) of the state in ``folder``, after checking that the file is complete (tensors
    are not read).

    Raises:
        DamagedFileError: the file is missing, truncated, empty, or its header lacks the fields
            a state holds.
    """
    path = Path(folder) / STATE_FILE
    header = check_safetensors(path, "the training state", DAMAGED_ADVICE)
    try:
        parsed = {key: json.loads(header[key]) for key in ("step", "config", "data_position", "param_groups",
                                                         "history")}
    except (KeyError, ValueError) as exc:
        raise DamagedFileError(f"the training state {str(path)!r} is damaged: its header lacks or garbles "
                               f"{exc}; {DAMAGED_ADVICE}") from exc
    return {"step": int(parsed["step"]), "config": parsed["config"], "data_position": parsed["data_position"],
            "inputs": json.loads(header.get("inputs", "{}"))}


def load_state(folder: str | Path) -> TrainingState:
    """Read a state written by :func:`save_state`.

    Raises:
        DamagedFileError: no state file in ``folder``, or a damaged one (see :func:`read_state_header`).
    """
    path = Path(folder) / STATE_FILE
    read_state_header(folder)
    lora, rng, optim, optim_state = {}, {}, {}, {}
    with safe_open(str(path), framework="pt") as fh:
        header = fh.metadata()
        for key in fh.keys():
            kind, _, rest = key.partition(".")
            if kind == "lora":
                lora[rest] = fh.get_tensor(key)
            elif kind == "rng":
                rng[rest] = fh.get_tensor(key)
            elif kind == "optim":
                optim[key] = fh.get_tensor(key)
    if "optimizer_layout" in header:
        optim_state = unpack_optimizer_state(json.loads(header["optimizer_layout"]), optim)
    else:  # a state saved before the layout: AdamW's slots, every one a tensor
        for key, tensor in optim.items():
            index, _, name = key.removeprefix("optim.").partition(".")
            optim_state.setdefault(int(index), {})[name] = tensor
    optimizer = {"state": optim_state, "param_groups": json.loads(header["param_groups"])}
    return TrainingState(int(header["step"]), json.loads(header["data_position"]), lora, optimizer,
                         rng, json.loads(header["history"]), json.loads(header["config"]),
                         json.loads(header.get("grad_scaler", "{}")), json.loads(header.get("inputs", "{}")),
                         header.get("optimizer_class", ""))


def rng_state(noise_gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The RNG states a resume restores: global CPU, the trainer's noise generator, CUDA (when in use)."""
    state = {"cpu": torch.random.get_rng_state(), "noise": noise_gen.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_rng_state(state: dict[str, torch.Tensor], noise_gen: torch.Generator) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.random.set_rng_state(state["cpu"])
    noise_gen.set_state(state["noise"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
