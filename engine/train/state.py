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

from ..config.outputs import STATE_FILE
from ..files.checks import DamagedFileError, check_safetensors
from ..files.tensors import atomic_save_file


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
        "inputs": json.dumps(state.inputs, separators=(",", ":"), sort_keys=True),
    }
    return atomic_save_file(tensors, Path(folder) / STATE_FILE, header)


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
                         json.loads(header.get("grad_scaler", "{}")), json.loads(header.get("inputs", "{}")))


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
