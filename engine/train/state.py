"""Resumable training state: one ``.safetensors`` file, written atomically.

It holds the LoRA weights, the AdamW state, the RNG states (global CPU, CUDA, and the trainer's
noise generator) as tensors, and, in the header, the step, the data position, the per-step
history and the config. Nothing is pickled, so loading a state file cannot run code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .atomic import atomic_save_file

STATE_FILE = "training_state.safetensors"


@dataclass
class TrainingState:
    """What a resumed run needs to continue bit-for-bit.

    Attributes:
        step: optimizer steps done.
        data_position: the sampler's ``{"epoch", "index"}``.
        lora: bare peft LoRA weights.
        optimizer: ``optimizer.state_dict()`` (tensors and param-group settings).
        rng: ``{"cpu": ..., "noise": ..., "cuda.<i>": ...}`` uint8 RNG state tensors.
        history: per-step records so far.
        config: the run's config as a dict (for the report; not used to override options).
        grad_scaler: ``torch.amp.GradScaler.state_dict()`` of fp16 loss scaling (empty otherwise).
    """

    step: int
    data_position: dict[str, int]
    lora: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    grad_scaler: dict[str, Any] = field(default_factory=dict)


def save_state(state: TrainingState, folder: str | Path) -> Path:
    """Write ``state`` to ``folder/training_state.safetensors`` atomically."""
    tensors = {f"lora.{k}": v.contiguous() for k, v in state.lora.items()}
    tensors.update({f"rng.{k}": v.contiguous() for k, v in state.rng.items()})
    for index, slots in state.optimizer["state"].items():
        for name, value in slots.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"optim.{index}.{name}"] = tensor.detach().cpu().contiguous()
    header = {
        "step": str(state.step),
        "data_position": json.dumps(state.data_position),
        "param_groups": json.dumps(state.optimizer["param_groups"]),
        "history": json.dumps(state.history),
        "config": json.dumps(state.config, default=str),
        "grad_scaler": json.dumps(state.grad_scaler),
    }
    return atomic_save_file(tensors, Path(folder) / STATE_FILE, header)


def read_state_header(folder: str | Path) -> dict[str, Any]:
    """The saved ``step`` and ``config`` of the state in ``folder``, without reading tensors."""
    with safe_open(str(Path(folder) / STATE_FILE), framework="pt") as fh:
        header = fh.metadata()
    return {"step": int(header["step"]), "config": json.loads(header["config"])}


def load_state(folder: str | Path) -> TrainingState:
    """Read a state written by :func:`save_state`.

    Raises:
        FileNotFoundError: no state file in ``folder``.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {path}")
    lora, rng, optim_state = {}, {}, {}
    with safe_open(str(path), framework="pt") as fh:
        header = fh.metadata()
        for key in fh.keys():
            kind, _, rest = key.partition(".")
            if kind == "lora":
                lora[rest] = fh.get_tensor(key)
            elif kind == "rng":
                rng[rest] = fh.get_tensor(key)
            elif kind == "optim":
                index, _, name = rest.partition(".")
                optim_state.setdefault(int(index), {})[name] = fh.get_tensor(key)
    optimizer = {"state": optim_state, "param_groups": json.loads(header["param_groups"])}
    return TrainingState(int(header["step"]), json.loads(header["data_position"]), lora, optimizer,
                         rng, json.loads(header["history"]), json.loads(header["config"]),
                         json.loads(header.get("grad_scaler", "{}")))
