"""The optimizer of a run and its learning-rate schedule.

AdamW (decoupled weight decay, Loshchilov & Hutter 2019) over the trainable LoRA parameters;
the learning rate of each step is the configured peak times :func:`lr_factor`. A new schedule is
a name in ``engine/config/optim.py`` (``LR_SCHEDULERS``) and its diffusers schedule here.
"""

from __future__ import annotations

from typing import Callable

import torch
from diffusers.optimization import get_scheduler

from ..config import OptimizerConfig

_DIFFUSERS_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""Each ``lr_scheduler`` value and the diffusers schedule that gives its shape."""


def make_optimizer(params: list[torch.nn.Parameter], optimizer: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` at the configured peak learning rate and weight decay."""
    return torch.optim.AdamW(params, lr=optimizer.learning_rate, weight_decay=optimizer.weight_decay)


def lr_factor(optimizer: OptimizerConfig, steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier of each optimizer step (0-based) of a ``steps``-step run,
    from diffusers' schedules.

    diffusers' ``get_scheduler`` (``constant_with_warmup``, ``linear``, ``cosine``: linear warm-up,
    then constant, linear decay to 0 at the last step, or half a cosine, Loshchilov & Hutter 2017)
    gives the shapes. Its warm-up counts from 0, so its first step would train at rate 0; here
    step ``s`` of the warm-up uses ``(s + 1) / warmup`` and the schedule is read at ``s`` after it.
    """
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_scheduler(_DIFFUSERS_SCHEDULES[optimizer.lr_scheduler], dummy,
                             num_warmup_steps=optimizer.lr_warmup_steps, num_training_steps=steps)
    factor, warmup = schedule.lr_lambdas[0], optimizer.lr_warmup_steps
    return lambda step: factor(step + 1 if step < warmup else step)


def learning_rate_at(optimizer: OptimizerConfig, steps: int, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of a ``steps``-step run; see :func:`lr_factor`."""
    return optimizer.learning_rate * lr_factor(optimizer, steps)(step)
