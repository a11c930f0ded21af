"""The optimizer of a run and its learning-rate schedule (read by ``engine/train/optim.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import check_options, option

LR_SCHEDULERS = ("constant", "linear", "cosine")
"""Learning-rate schedules after the warm-up (diffusers' ``get_scheduler`` shapes)."""


def _scheduler(value: Any) -> Any:
    """diffusers' and SimpleTuner's ``constant_with_warmup`` is ``constant`` here (the warm-up is its own key)."""
    return "constant" if value == "constant_with_warmup" else value


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) and its schedule; gradients of
    ``gradient_accumulation_steps`` micro-batches are summed into one update. Validated at
    construction.

    Raises:
        ConfigError: a field is out of range.
    """

    learning_rate: float = option(1e-3, "AdamW learning rate (peak, after warm-up).", "--lr", above=0, step=1e-5)
    lr_scheduler: str = option("constant", "Learning-rate schedule after warm-up: constant, linear (to 0) or "
                               "cosine (to 0); diffusers' schedules (constant_with_warmup reads as constant: the "
                               "warm-up is lr_warmup_steps).", "--lr-scheduler", choices=LR_SCHEDULERS,
                               parse=_scheduler)
    lr_warmup_steps: int = option(0, "Steps of linear learning-rate warm-up (step k of W uses k/W of the rate).",
                                  "--lr-warmup-steps", min=0, max=10**8)
    weight_decay: float = option(0.0, "AdamW decoupled weight decay.", "--weight-decay", min=0, max=1e3, step=1e-4)
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", "--grad-accum", min=1,
                                              max=1024)

    def __post_init__(self) -> None:
        check_options(self)
