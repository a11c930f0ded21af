"""The Noise Schedule node: how a Train LoRA run draws its noise levels, shifts and weights them,
and the guidance a distilled model trains at (``engine/config/objective.py``; the defaults are the
family's own, so a graph without this node trains that way)."""

from __future__ import annotations

from .environment import public_errors
from .payloads import CATEGORY, NOISE_SCHEDULE
from .widgets import NodeOptions, widget

KEYS = ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift", "loss_weighting", "snr_gamma",
        "guidance_value")
"""The node's widgets, each the engine option of its name."""


class NoiseSchedule:
    """Timestep sampling, flow shift (auto: the family's inference shift), loss weighting and
    guidance; connect to Train LoRA. Without it Train LoRA uses these defaults."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (NOISE_SCHEDULE,), ("noise_schedule",)
    OPTIONS = NodeOptions({key: key for key in KEYS})

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {key: widget(key) for key in KEYS}}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @public_errors
    def build(self, **inputs):
        self.OPTIONS.validate(inputs)
        return (self.OPTIONS.config(inputs).objective,)
