"""The Noise Schedule node: how a Train LoRA run draws its noise levels, shifts and weights them,
and the guidance a distilled model trains at (``engine/config/objective.py``; the defaults are the
family's own, so a graph without this node trains that way)."""

from __future__ import annotations

from .environment import public_errors
from .payloads import CATEGORY, Sockets
from .v3 import io
from .widgets import NodeOptions, widget

KEYS = ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift", "loss_weighting", "snr_gamma",
        "guidance_value")
"""The node's widgets, each the engine option of its name."""


class NoiseSchedule(io.ComfyNode):
    """Timestep sampling, flow shift (auto: the family's inference shift), loss weighting and
    guidance; connect to Train LoRA. Without it Train LoRA uses these defaults."""

    OPTIONS = NodeOptions({key: key for key in KEYS})

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptNoiseSchedule",
                         display_name="Noise Schedule (timesteps, shift, loss weighting, guidance)", category=CATEGORY,
                         inputs=[widget(key) for key in KEYS],
                         outputs=[Sockets.noise_schedule.Output(display_name="noise_schedule")])

    @classmethod
    def validate_inputs(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @classmethod
    @public_errors
    def execute(cls, **inputs):
        cls.OPTIONS.validate(inputs)
        return io.NodeOutput(cls.OPTIONS.config(inputs).objective)
