"""LoRA: configuration, injection through peft, and the ``.safetensors`` file format.

Files are written in the diffusers key format with the ``transformer.`` prefix
(``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``), which both diffusers'
``load_lora_weights`` and ComfyUI's own LoRA loader map (SPEC.md "LoRA files": bare peft keys
load zero keys in ComfyUI 0.3.64). Keys never carry the peft adapter name. Where alpha != rank a
``<module>.alpha`` scalar is written as well; the safetensors header holds the metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from .atomic import atomic_save_file
from .precision import quiet_torchao

PREFIX = "transformer."


class LoraConfigError(ValueError):
    """A LoRA setting is invalid; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters.

    Attributes:
        rank: LoRA rank r >= 1.
        alpha: LoRA alpha > 0; the update is scaled by ``alpha / rank`` (Hu et al., 2021).
        target_modules: module names to adapt; ``None`` = the family's attention projections.
        dropout: LoRA dropout probability in [0, 1).
        init: peft ``init_lora_weights`` (``True`` = B zero-initialised, the standard start).

    Raises:
        LoraConfigError: rank < 1, alpha <= 0, dropout outside [0, 1), empty target list.
    """

    rank: int = field(default=16, metadata={"key": "lora_rank", "cli": "--rank", "help": "LoRA rank r."})
    alpha: float = field(default=16.0, metadata={"key": "lora_alpha", "cli": "--alpha",
                                                 "help": "LoRA alpha; the update is scaled by alpha / rank."})
    target_modules: tuple[str, ...] | None = field(default=None, metadata={
        "key": "lora_target_modules", "cli": "--targets",
        "help": "Module names to adapt (default: the family's attention projections)."})
    dropout: float = field(default=0.0, metadata={"key": "lora_dropout", "cli": "--lora-dropout",
                                                  "help": "LoRA dropout probability."})
    init: bool | str = True

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 1 <= self.rank <= 4096:
            raise LoraConfigError(f"lora_rank={self.rank!r} is invalid: allowed an integer from 1 to 4096.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < float("inf"):
            raise LoraConfigError(f"lora_alpha={self.alpha!r} is invalid: allowed a finite number > 0.")
        if self.target_modules is not None and not all(isinstance(t, str) and t for t in self.target_modules):
            raise LoraConfigError(f"lora_target_modules={list(self.target_modules)!r} is invalid: allowed "
                                  "a list of module names (strings).")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise LoraConfigError(f"lora_dropout={self.dropout!r} is invalid: allowed 0 <= dropout < 1.")
        if self.target_modules is not None and len(self.target_modules) == 0:
            raise LoraConfigError("lora_target_modules=[] is invalid: allowed a non-empty list of module names.")


CONFIG_KEYS = {f.metadata["key"]: f.name for f in fields(LoraSettings) if "key" in f.metadata}
"""Config key (``lora_rank``, ...) -> :class:`LoraSettings` field."""
HELP = {f.metadata["key"]: f.metadata["help"] for f in fields(LoraSettings) if "key" in f.metadata}
"""Help text of each LoRA config key."""


def add_lora(model: torch.nn.Module, settings: LoraSettings, default_targets: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """Freeze ``model`` and inject a LoRA adapter with peft; return the trainable parameters.

    The adapter's weights are fp32 whatever the base's dtype (bf16, fp16, quantized): peft
    creates them in the base layer's dtype, and bf16 LoRA updates lose small steps.

    Raises:
        LoraConfigError: no module of ``model`` matches the target names.
    """
    targets = list(settings.target_modules or default_targets)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, init_lora_weights=settings.init)
    model.requires_grad_(False)
    try:
        with quiet_torchao():  # peft imports torchao (when installed) to recognise quantized layers
            if isinstance(model, PeftAdapterMixin):
                model.add_adapter(config)
            else:  # diffusers classes without PeftAdapterMixin (PixArt, OmniGen, DiT, ...)
                inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise LoraConfigError(f"lora_target_modules={targets!r} matched no module of "
                              f"{type(model).__name__}: {exc}") from exc
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.dtype != torch.float32:
            p.data = p.data.float()
    return params


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's key format without the adapter name (no ``.default.``)."""
    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_lora_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load weights from :func:`lora_state_dict` (bare keys) into the model's adapter.

    Raises:
        ValueError: keys missing from or unexpected for the model's adapter.
    """
    result = set_peft_model_state_dict(model, dict(state))
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"LoRA state has keys the model's adapter does not: {unexpected[:4]}")


def to_file_keys(state: Mapping[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """Bare peft keys -> file keys: ``transformer.`` prefix, plus ``.alpha`` where alpha != rank."""
    out = {PREFIX + k: v for k, v in state.items()}
    if float(settings.alpha) != float(settings.rank):
        for key in state:
            if key.endswith(".lora_A.weight"):
                out[PREFIX + key[: -len(".lora_A.weight")] + ".alpha"] = torch.tensor(float(settings.alpha))
    return out


def save_lora(model: torch.nn.Module, path: str | Path, settings: LoraSettings,
              metadata: Mapping[str, Any] | None = None) -> Path:
    """Save the model's LoRA as a ComfyUI/diffusers-loadable ``.safetensors`` file (atomic).

    Args:
        model: a model with a peft adapter.
        path: destination file.
        settings: the LoRA settings (rank, alpha go to the header and the ``.alpha`` keys).
        metadata: more header fields (family, schedule, ...); values are JSON-encoded.
    """
    header = {"format": "diffusers-lora", "lora_settings": json.dumps(asdict(settings))}
    header.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    return atomic_save_file(to_file_keys(lora_state_dict(model), settings), path, header)
