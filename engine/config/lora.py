"""LoRA hyper-parameters (read by ``engine/model/lora_files.py``, which injects the adapter with
peft and writes its files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import check_options, option


class LoraConfigError(ValueError):
    """A LoRA setting is invalid; the message names the key, the value and what is allowed."""


def _module_names(value: Any) -> Any:
    """``lora_target_modules``: one module name, a non-empty list of names, or unset."""
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value
    if names is not None and not (isinstance(names, tuple) and names and all(isinstance(v, str) and v for v in names)):
        raise LoraConfigError(f"lora_target_modules={value!r} is invalid: allowed a module name or a non-empty list "
                              "of module names (strings).")
    return names


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters. Validated at construction.

    Attributes:
        rank: LoRA rank r >= 1.
        alpha: LoRA alpha > 0; the update is scaled by ``alpha / rank`` (Hu et al., 2021).
        target_modules: module names to adapt; ``None`` = the family's attention projections.
        dropout: LoRA dropout probability in [0, 1).
        init: peft ``init_lora_weights`` (``True`` = B zero-initialised, the standard start).

    Raises:
        LoraConfigError: rank < 1, alpha <= 0, dropout outside [0, 1), empty target list.
    """

    rank: int = option(16, "LoRA rank r.", "--rank", key="lora_rank", min=1, max=4096)
    alpha: float = option(16.0, "LoRA alpha; the update is scaled by alpha / rank.", "--alpha", key="lora_alpha",
                          above=0, max=1e30)
    target_modules: tuple[str, ...] | None = option(
        None, "Module names to adapt (default: the family's attention projections).", "--targets",
        key="lora_target_modules", parse=_module_names)
    dropout: float = option(0.0, "LoRA dropout probability.", "--lora-dropout", key="lora_dropout", min=0, below=1,
                            step=0.01)
    init: bool | str = True

    def __post_init__(self) -> None:
        check_options(self, LoraConfigError)
