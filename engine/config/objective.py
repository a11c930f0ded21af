"""The training objective's recipe: how noise levels are drawn, shifted and weighted, and the
guidance a distilled model is trained at (read by ``engine/train/objectives.py``).

The names follow diffusers' training scripts (``weighting_scheme``'s ``logit_normal`` / ``mode`` /
``uniform``, ``logit_mean``, ``logit_std``, ``mode_scale``; ``sigma_sqrt`` and ``cosmap``;
``snr_gamma``) and SimpleTuner (``flux_guidance_value``); the draws and weights are diffusers'
``training_utils`` functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..families import family_names, get_family
from .options import ConfigError, check_options, option

TIMESTEP_SAMPLING = ("logit_normal", "uniform", "mode")
"""``compute_density_for_timestep_sampling``'s schemes (Esser et al. 2024, "Scaling Rectified Flow
Transformers", section 3.1)."""
FLOW_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
"""Loss weightings of the flow objective (``compute_loss_weighting_for_sd3``)."""
EPSILON_WEIGHTINGS = ("none", "min_snr")
"""Loss weightings of the epsilon objective (min-SNR-gamma, Hang et al. 2023)."""
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap", "min_snr")
AUTO = "auto"
MAX_SHIFT = 100.0
MODE_SCALE_MAX = 1.75
"""The ``mode`` density maps ``[0, 1]`` onto itself monotonically for scales in ``[-1, 2 / (pi - 2)]``
(2/(pi-2) = 1.7519; SD3 paper, section 3.1): the bounds of ``mode_scale``."""


def _flow_shift(value: Any) -> Any:
    """``flow_shift``: ``auto`` or a number in ``(0, 100]`` (a numeric string too), canonically a
    string (``"auto"``, ``"3.0"``)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not 0 < number <= MAX_SHIFT:  # also refuses nan and inf
        raise ConfigError(f"flow_shift={value!r} is invalid: allowed auto (the family's own inference shift) or a "
                          f"number > 0 and <= {MAX_SHIFT:g} (1 = no shift).")
    return repr(number)


@dataclass(frozen=True)
class ObjectiveConfig:
    """How a run draws its noise levels and weights its loss. Validated at construction; the rules
    that depend on the family (its objective, its guidance input) are :func:`check_objective`'s.

    Raises:
        ConfigError: a field is out of range.
    """

    timestep_sampling: str = option(
        "logit_normal", "Flow families: how noise levels are drawn before the shift: logit_normal (sigmoid of a "
        "normal draw, logit_mean / logit_std), uniform, or mode (mode_scale) - diffusers' "
        "compute_density_for_timestep_sampling (SD3's weighting_scheme).", "--timestep-sampling",
        choices=TIMESTEP_SAMPLING, long_run=True)
    logit_mean: float = option(0.0, "logit_normal's mean (> 0 draws more noise).", "--logit-mean", min=-10, max=10,
                               step=0.1, long_run=True)
    logit_std: float = option(1.0, "logit_normal's standard deviation.", "--logit-std", above=0, max=10, step=0.1,
                              long_run=True)
    mode_scale: float = option(1.29, "mode's scale (SD3's default 1.29; 0 = uniform).", "--mode-scale", min=-1,
                               max=MODE_SCALE_MAX, step=0.01, long_run=True)
    flow_shift: str = option(
        AUTO, "Flow families: shift of the drawn noise levels, s*t/(1+(s-1)*t): auto = the family's own inference "
        "shift (the model folder's scheduler/scheduler_config.json, else the family's released config, "
        "docs/FAMILIES.md; resolution-dependent ones per bucket and frame count, from its image tokens), or a "
        "number (1 = no shift).", "--flow-shift", parse=_flow_shift, long_run=True,
        allowed=f"auto or a number > 0 and <= {MAX_SHIFT:g}")
    loss_weighting: str = option(
        "none", "Per-sample loss weights: none; flow families sigma_sqrt or cosmap (diffusers' "
        "compute_loss_weighting_for_sd3); epsilon families min_snr (min(SNR, snr_gamma) / SNR, diffusers' "
        "compute_snr).", "--loss-weighting", choices=LOSS_WEIGHTINGS, long_run=True)
    snr_gamma: float = option(5.0, "min_snr's gamma (Hang et al. 2023 recommend 5).", "--snr-gamma", above=0,
                              max=1000, step=0.5, long_run=True)
    guidance_value: float = option(
        1.0, "Guidance-distilled models (Flux.1-dev, Flux.2 dev, HunyuanVideo): the guidance input trained at "
        "(SimpleTuner's flux_guidance_value); other families: 1 only.", "--guidance-value", min=0, max=100,
        step=0.1, long_run=True)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def shift(self) -> float | None:
        """``flow_shift`` as a number, ``None`` for ``auto``."""
        return None if self.flow_shift == AUTO else float(self.flow_shift)


def check_objective(objective: ObjectiveConfig, family: Any) -> None:
    """The rules across the objective and ``family`` (a ``FamilyAdapter``).

    Raises:
        ConfigError: an epsilon family given a flow sampling (or its parameters), shift or
            weighting (or ``min_snr`` on a flow family); ``guidance_value`` other than 1 for a family without a guidance input.
    """
    defaults = ObjectiveConfig()
    if family.objective == "epsilon":
        for key in ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift"):
            if getattr(objective, key) != getattr(defaults, key):
                raise ConfigError(f"{key}={getattr(objective, key)!r} is invalid for family {family.name!r}: allowed "
                                  f"{getattr(defaults, key)} (its epsilon objective draws its DDPM steps uniformly; "
                                  f"{key} applies to flow families).")
    weightings = EPSILON_WEIGHTINGS if family.objective == "epsilon" else FLOW_WEIGHTINGS
    if objective.loss_weighting not in weightings:
        raise ConfigError(f"loss_weighting={objective.loss_weighting!r} is invalid for family {family.name!r} "
                          f"({family.objective} objective): allowed {', '.join(weightings)}.")
    if objective.guidance_value != 1.0 and not family.guidance_input:
        guided = ", ".join(name for name in family_names() if get_family(name).guidance_input)
        raise ConfigError(f"guidance_value={objective.guidance_value!r} is invalid for family {family.name!r}: allowed "
                          f"1 (it has no guidance input; guidance-distilled families: {guided}).")
