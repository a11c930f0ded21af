"""The optimizer of a run, its learning-rate schedule and gradient clipping (read by
``engine/train/optim.py`` and ``engine/train/step.py``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from .options import ConfigError, check_options, option


@dataclass(frozen=True)
class LRSchedule:
    """One learning-rate schedule after the warm-up: everything the engine reads of it.

    Attributes:
        name: the ``lr_scheduler`` value.
        diffusers: the name of diffusers' ``get_scheduler`` shape that gives its factor per step
            (``engine/train/optim.py`` ``lr_factor``).
        decays: its rate at a step depends on the run's total steps (it decays over the whole run),
            so a resume that changes ``steps`` changes the rate of the steps left, which the resume
            check warns of (``engine/config/train.py`` ``warn_resume_schedule``).
    """

    name: str
    diffusers: str
    decays: bool


LR_SCHEDULES: dict[str, LRSchedule] = {s.name: s for s in (
    LRSchedule("constant", "constant_with_warmup", decays=False),
    LRSchedule("linear", "linear", decays=True),
    LRSchedule("cosine", "cosine", decays=True),
)}
"""Every learning-rate schedule, declared once (docs/EXTENDING.md "Add a learning-rate schedule")."""
LR_SCHEDULERS = tuple(LR_SCHEDULES)
"""Allowed values of ``lr_scheduler`` (the option's choices, the CLI's and the node's)."""

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy")
"""Allowed values of ``optimizer``; each one's constructor and state rules are a row of
``engine/train/optim.py`` (``OPTIMIZER_TABLE``)."""

SIMPLETUNER_OPTIMIZERS = {"adamw_bf16": "adamw", "optimi-adamw": "adamw", "ao-adamw4bit": "adamw",
                          "ao-adamwfp8": "adamw", "ao-adamw8bit": "adamw8bit", "bnb-adamw8bit": "adamw8bit"}
"""SimpleTuner's ``optimizer`` names spelled otherwise here, and the optimizer each trains with
here: its AdamWs whose state is stored in bf16, 4-bit or fp8 are torch's AdamW (fp32 state), its
8-bit AdamWs ``adamw8bit`` (docs/OPTIONS.md "SimpleTuner configs"); ``adamw`` and ``prodigy`` are spelled alike."""


PROVIDERS = {"adamw": ("torch.optim",), "adafactor": ("torch.optim",), "adamw8bit": ("torchao", "bitsandbytes"),
             "prodigy": ("prodigyopt",)}
"""The packages that implement each optimizer, the preferred first (torchao's AdamW8bit, else
bitsandbytes'); ``torch.optim`` is always there."""
PIP = {"torchao": "pip install torchao", "bitsandbytes": "pip install bitsandbytes",
       "prodigyopt": "pip install prodigyopt"}
"""What installs each optional package (the ``optimizers`` extra of pyproject.toml installs
torchao and prodigyopt)."""


def optimizer_provider(name: str, device_type: str = "cpu") -> str:
    """The package whose implementation of optimizer ``name`` runs here: the first of
    :data:`PROVIDERS` installed (found, not imported). torchao's AdamW8bit compiles its update with
    ``torch.compile``, which needs triton on CUDA: without triton there, bitsandbytes' is used.

    Args:
        device_type: ``cpu`` or ``cuda``: the run's device.

    Raises:
        ConfigError: no package that implements it is installed (one line naming the pip command).
    """
    for package in PROVIDERS[name]:
        if package == "torch.optim":
            return package
        if importlib.util.find_spec(package) is None:
            continue
        if package == "torchao" and device_type == "cuda" and importlib.util.find_spec("triton") is None:
            continue
        return package
    needs = " or ".join(f"{p} ({PIP[p]}{' with triton' if p == 'torchao' and device_type == 'cuda' else ''})"
                        for p in PROVIDERS[name])
    raise ConfigError(f"optimizer={name!r} needs {needs}, which is not installed here; allowed "
                      f"{', '.join(n for n, ps in PROVIDERS.items() if ps == ('torch.optim',))} without it.")


def _scheduler(value: Any) -> Any:
    """diffusers' and SimpleTuner's ``constant_with_warmup`` is ``constant`` here (the warm-up is its own key)."""
    return "constant" if value == "constant_with_warmup" else value


def _optimizer(value: Any) -> Any:
    """A SimpleTuner optimizer name as the optimizer it trains with here (:data:`SIMPLETUNER_OPTIMIZERS`)."""
    return SIMPLETUNER_OPTIMIZERS.get(value, value) if isinstance(value, str) else value


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer over the LoRA parameters (decoupled weight decay for each), its schedule and
    gradient clipping; gradients of ``gradient_accumulation_steps`` micro-batches are summed into
    one update. Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    learning_rate: float = option(1e-3, "Learning rate (peak, after warm-up). prodigy estimates its own step size "
                                  "and multiplies it by this: 1.0 there, as its authors advise.", "--lr", above=0,
                                  step=1e-5)
    lr_scheduler: str = option("constant", "Learning-rate schedule after warm-up: constant, linear (to 0) or "
                               "cosine (to 0); diffusers' schedules (constant_with_warmup reads as constant: the "
                               "warm-up is lr_warmup_steps).", "--lr-scheduler", choices=LR_SCHEDULERS,
                               parse=_scheduler)
    lr_warmup_steps: int = option(0, "Steps of linear learning-rate warm-up (step k of W uses k/W of the rate).",
                                  "--lr-warmup-steps", min=0, max=10**8)
    weight_decay: float = option(0.0, "Decoupled weight decay (every optimizer).", "--weight-decay", min=0, max=1e3,
                                 step=1e-4)
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", "--grad-accum", min=1,
                                              max=1024)
    name: str = option("adamw", "Optimizer: adamw (torch's AdamW, fp32 moments: 8 bytes per LoRA parameter); "
                       "adamw8bit (torchao's AdamW8bit, block-quantized 8-bit moments: about 2 bytes per parameter; "
                       "bitsandbytes' where torchao is not installed); adafactor (torch's Adafactor: factored "
                       "second moment, no first); prodigy (prodigyopt: estimates its own step size; learning_rate "
                       "1.0; 4 fp32 states per parameter). SimpleTuner's names are read too.", "--optimizer",
                       choices=OPTIMIZERS, parse=_optimizer, key="optimizer")
    max_grad_norm: float = option(1.0, "Clip the LoRA gradients' total L2 norm to this before each update "
                                  "(torch.nn.utils.clip_grad_norm_, after fp16 loss unscaling, as diffusers' training "
                                  "scripts do); 0: off. The norm before clipping is logged every step.",
                                  "--max-grad-norm", above=0, max=1e6, off=0, step=0.1)

    def __post_init__(self) -> None:
        check_options(self)
