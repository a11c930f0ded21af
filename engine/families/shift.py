"""A flow family's inference shift: its released scheduler config as data (:class:`FlowShift`), a model
folder's ``scheduler/scheduler_config.json`` over it, and the ``mu`` a batch's image tokens resolve it to
through the family's diffusers pipeline function. A static shift ``s`` (``s t / (1 + (s - 1) t)``) is the
time shift ``mu = ln s``; a dynamic one (``use_dynamic_shifting``) takes ``mu`` from ``calculate_shift`` of
the tokens (Flux.2: ``compute_empirical_mu``), mapped by the scheduler's ``time_shift(mu, 1, t)``. Training
draws are not stretched to ``shift_terminal`` (an inference schedule's last step; musubi-tuner and
SimpleTuner do not stretch either); previews are. docs/FAMILIES.md "Noise schedule" lists the families'.
A model folder's own config is read by ``scheduler_config.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .lazy import import_attribute


@dataclass(frozen=True)
class ResolvedShift:
    """The shift of one token count, ``t -> time_shift(mu, 1, t)``: ``mu`` (``ln s`` of a static ``s``),
    its ``time_shift_type``, the ``tokens`` it was resolved for and whether ``mu`` is ``dynamic``."""

    mu: float
    time_shift_type: str = "exponential"
    tokens: int | None = None
    dynamic: bool = False

    @property
    def shift(self) -> float:
        """The static shift with the same effect: ``e^mu`` (``mu`` for the linear type)."""
        return math.exp(self.mu) if self.time_shift_type == "exponential" else self.mu

    def to_dict(self) -> dict[str, Any]:
        return {"shift": self.shift, "mu": self.mu, "time_shift_type": self.time_shift_type, "tokens": self.tokens,
                "dynamic": self.dynamic}


def static_shift(shift: float) -> ResolvedShift:
    """A static ``shift`` (a finite number > 0) as the exponential time shift ``mu = ln shift``."""
    return ResolvedShift(math.log(shift))


@dataclass(frozen=True)
class FlowShift:
    """A flow family's scheduler config, as far as it shifts noise levels, and its pipeline's mu rule.

    The scheduler keys default to ``FlowMatchEulerDiscreteScheduler``'s (diffusers 0.42), which a config
    file's missing keys take (``tests/train/test_objectives.py`` compares them); ``scheduler_config.py`` reads one.

    Attributes:
        shift: the static shift; use_dynamic_shifting: mu from the image tokens through :attr:`mu_rule`.
        base_shift, max_shift, base_image_seq_len, max_image_seq_len: ``calculate_shift``'s line.
        time_shift_type: ``exponential`` or ``linear``. shift_terminal: an inference's last sigma, or ``None``.
        mu_rule: ``"<module under diffusers.pipelines>:<function>"``, the pipeline's mu function.
        mu_steps: the rule takes ``(tokens, steps)`` (Flux.2's ``compute_empirical_mu`` at its pipeline's
            default steps); ``None``: ``(tokens, base_image_seq_len, max_image_seq_len, base_shift, max_shift)``.
        mu_pixels_per_token: the rule takes ``(height=, width=, base_mu=)`` in pixels (Ideogram 4's
            ``_resolution_aware_mu`` at its pipeline's default ``mu`` 0), one image token covering this many
            pixels; only the area ``height * width`` enters the rule, so a square of the same area is passed.
        source: where the values come from (the released config, or the file read).
    """

    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None
    mu_rule: str = "flux.pipeline_flux:calculate_shift"
    mu_steps: int | None = None
    mu_pixels_per_token: int | None = None
    source: str = ""

    def resolve(self, tokens: int) -> ResolvedShift:
        """The shift of a sample of ``tokens`` image tokens: the static ``shift``, or with dynamic shifting
        the mu the pipeline's own function computes for them (imported from diffusers on first use)."""
        if not self.use_dynamic_shifting:
            return static_shift(self.shift)
        module, name = self.mu_rule.split(":")
        rule = import_attribute(f"diffusers.pipelines.{module}", name)
        if self.mu_steps is not None:
            mu = rule(tokens, self.mu_steps)
        elif self.mu_pixels_per_token is not None:
            side = math.sqrt(tokens * self.mu_pixels_per_token)
            mu = rule(height=side, width=side, base_mu=0.0)
        else:
            mu = rule(tokens, self.base_image_seq_len, self.max_image_seq_len, self.base_shift, self.max_shift)
        return ResolvedShift(float(mu), self.time_shift_type, tokens, True)

    def describe(self) -> str:
        """One line: ``shift 3`` or ``dynamic: mu 0.5 at 256 to 1.15 at 4096 tokens`` (+ ``shift_terminal``)."""
        terminal = f", shift_terminal {self.shift_terminal:g}" if self.shift_terminal else ""
        kind = "" if self.time_shift_type == "exponential" else f", {self.time_shift_type}"
        if not self.use_dynamic_shifting:
            return f"shift {self.shift:g}{terminal}"
        if self.mu_steps is not None:
            return f"dynamic: {self.mu_rule.split(':')[1]}(tokens, {self.mu_steps} steps){kind}{terminal}"
        if self.mu_pixels_per_token is not None:
            return f"dynamic: {self.mu_rule.split(':')[1]}(height x width, base mu 0){kind}{terminal}"
        return (f"dynamic: mu {self.base_shift:g} at {self.base_image_seq_len} to {self.max_shift:g} at "
                f"{self.max_image_seq_len} tokens{kind}{terminal}")

