"""The optimizer of a run and its learning-rate schedule.

The optimizer is a row of :data:`OPTIMIZER_TABLE`, chosen by ``optimizer`` and the package that
implements it here (``engine/config/optim.py`` ``optimizer_provider``): torch's AdamW (decoupled
weight decay, Loshchilov & Hutter 2019) and Adafactor (Shazeer & Stern 2018), torchao's or
bitsandbytes' AdamW8bit (Dettmers et al. 2022, block-wise 8-bit moments), prodigyopt's Prodigy
(Mishchenko & Defazio 2024, which estimates its own step size: ``learning_rate`` multiplies it, 1.0
as its authors advise). Each takes the configured learning rate and decoupled weight decay; their
state goes into the resumable state through ``engine/train/state.py``. The learning rate of each
step is the configured peak times :func:`lr_factor`; a new schedule is a row of
``engine/config/optim.py`` (``LR_SCHEDULES``: its name, its diffusers shape, whether it decays).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from diffusers.optimization import get_scheduler

from ..config import ConfigWarning, OptimizerConfig
from ..config.optim import LR_SCHEDULES, optimizer_provider
from ..families.lazy import lazy_imports
from ..model.distributed import full_tensor
from ..model.precision import quiet_torchao

Params = list[torch.nn.Parameter]
PRODIGY_LEAST_RATE = 0.1
"""Below this learning rate a Prodigy run is warned (prodigyopt's README: lr 1.0; it scales its estimate)."""


def _adamw(params: Params, config: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def _adafactor(params: Params, config: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def _torchao_adamw8bit(params: Params, config: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    """torchao's AdamW8bit; on the CPU its ``torch.compile``-d update runs eagerly (no C++
    compiler needed, and the CPU memory tracker, a dispatch mode dynamo cannot trace, sees it)."""
    with lazy_imports(), quiet_torchao():
        from torchao.optim import AdamW8bit
    optimizer = AdamW8bit(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    if device_type == "cpu":
        step = optimizer.step  # this instance's only: nothing process-wide is changed between steps

        def eager_step(*args: Any, **kwargs: Any) -> Any:
            with torch.compiler.set_stance("force_eager"), quiet_torchao():
                return step(*args, **kwargs)
        optimizer.step = eager_step  # type: ignore[method-assign]
    return optimizer


def _bitsandbytes_adamw8bit(params: Params, config: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    with lazy_imports():
        from bitsandbytes.optim import AdamW8bit
    return AdamW8bit(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def _prodigy(params: Params, config: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    with lazy_imports():
        from prodigyopt import Prodigy
    return Prodigy(params, lr=config.learning_rate, weight_decay=config.weight_decay, decouple=True)


@dataclass(frozen=True)
class OptimizerKind:
    """One implementation of an ``optimizer`` value.

    Attributes:
        name: the ``optimizer`` value. provider: the package that implements it
            (``engine/config/optim.py`` ``PROVIDERS``).
        build: ``(params, config, device type) -> optimizer`` at the configured learning rate and
            weight decay.
        state_per_param: what its state holds per LoRA parameter (docs; the bytes are measured).
    """

    name: str
    provider: str
    build: Callable[[Params, OptimizerConfig, str], torch.optim.Optimizer]
    state_per_param: str


OPTIMIZER_TABLE: dict[tuple[str, str], OptimizerKind] = {(k.name, k.provider): k for k in (
    OptimizerKind("adamw", "torch.optim", _adamw, "two fp32 moments (8 bytes)"),
    OptimizerKind("adamw8bit", "torchao", _torchao_adamw8bit, "two 8-bit moments and an fp32 scale per 256 "
                  "(about 2 bytes; tensors under 4096 values stay fp32)"),
    OptimizerKind("adamw8bit", "bitsandbytes", _bitsandbytes_adamw8bit, "two 8-bit moments and an fp32 scale per "
                  "256 (about 2 bytes; tensors under 4096 values stay fp32)"),
    OptimizerKind("adafactor", "torch.optim", _adafactor, "a factored second moment: a row and a column vector per "
                  "matrix (fp32), no first moment"),
    OptimizerKind("prodigy", "prodigyopt", _prodigy, "two fp32 moments, the initial weights and an fp32 "
                  "accumulator (16 bytes)"),
)}
"""Every optimizer by ``(optimizer, provider)``; no other module compares optimizer names."""


def make_optimizer(params: Params, optimizer: OptimizerConfig, device_type: str = "cpu") -> torch.optim.Optimizer:
    """The configured optimizer over ``params``, from the package that implements it here (a
    ``ConfigWarning`` when Prodigy gets a learning rate below :data:`PRODIGY_LEAST_RATE`).

    Raises:
        ConfigError: its package is not installed (one line naming the pip command).
    """
    kind = OPTIMIZER_TABLE[optimizer.name, optimizer_provider(optimizer.name, device_type)]
    if optimizer.name == "prodigy" and optimizer.learning_rate < PRODIGY_LEAST_RATE:
        warnings.warn(f"optimizer=prodigy with learning_rate={optimizer.learning_rate:g}: Prodigy estimates its own "
                      f"step size and multiplies it by the learning rate; its authors advise 1.0 (--lr 1)",
                      ConfigWarning, stacklevel=3)
    return kind.build(params, optimizer, device_type)


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as ``module.Name`` (``torchao.optim.adam.AdamW8bit``): the report's and
    the saved state's record of which implementation's state it is."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; one an optimizer keeps as a tensor (torchao's, so that a new
    rate does not recompile its step) is filled in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping as tensors the group settings the optimizer
    holds as tensors (the saved state holds their values as numbers)."""
    tensors = [{k: v for k, v in group.items() if isinstance(v, torch.Tensor)} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, tensors):
        for key, tensor in kept.items():
            if not isinstance(group[key], torch.Tensor):
                group[key] = tensor.fill_(group[key])


def clip_gradients(params: Params, max_norm: float) -> torch.Tensor:
    """The gradients' total L2 norm before clipping (0-d, not synchronised) and, with
    ``max_norm > 0``, the gradients clipped as ``torch.nn.utils.clip_grad_norm_`` clips them (its
    two halves, ``get_total_norm`` and ``clip_grads_with_norm_``: each gradient times
    ``min(1, max_norm / (norm + 1e-6))``), so that their norm is at most ``max_norm``.

    A non-finite norm leaves the gradients as they are (``clip_grad_norm_`` would make every one of
    them NaN): the non-finite guard then names the module whose gradient is not finite. Sharded
    (DTensor) gradients: the norm is the whole model's (gathered, as torchtitan does), each shard
    scaled by it.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = full_tensor(torch.nn.utils.get_total_norm(grads, 2.0))
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.where(norm.isfinite(), norm, 0.0))
    return norm


def clipped(max_norm: float, norm: float) -> bool:
    """Whether :func:`clip_gradients` scaled gradients of total norm ``norm`` down (a finite norm
    above ``max_norm - 1e-6``, clipping on)."""
    return max_norm > 0 and math.isfinite(norm) and max_norm / (norm + 1e-6) < 1.0


def lr_factor(optimizer: OptimizerConfig, steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier of each optimizer step (0-based) of a ``steps``-step run,
    from diffusers' schedules.

    diffusers' ``get_scheduler`` (``constant_with_warmup``, ``linear``, ``cosine``: linear warm-up,
    then constant, linear decay to 0 at the last step, or half a cosine, Loshchilov & Hutter 2017)
    gives the shapes. Its warm-up counts from 0, so its first step would train at rate 0; here
    step ``s`` of the warm-up uses ``(s + 1) / warmup`` and the schedule is read at ``s`` after it.
    """
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_scheduler(LR_SCHEDULES[optimizer.lr_scheduler].diffusers, dummy,
                             num_warmup_steps=optimizer.lr_warmup_steps, num_training_steps=steps)
    factor, warmup = schedule.lr_lambdas[0], optimizer.lr_warmup_steps
    return lambda step: factor(step + 1 if step < warmup else step)


def learning_rate_at(optimizer: OptimizerConfig, steps: int, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of a ``steps``-step run; see :func:`lr_factor`."""
    return optimizer.learning_rate * lr_factor(optimizer, steps)(step)
