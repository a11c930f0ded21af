"""The Fit Guardrails node: the pre-flight budget, out-of-memory recovery and the slowdown watchdog
of a Train LoRA run (``engine/config/guardrails.py``; the facade's ``train`` applies them)."""

from __future__ import annotations

from ..engine import api
from .environment import public_errors
from .payloads import CATEGORY, GUARDRAILS
from .widgets import NodeOptions, widget

NO_PREFLIGHT = " Unset: no pre-flight."


class FitGuardrails:
    """Pre-flight verdict (a memory budget), recovery from out-of-memory, and the watchdog; connect to
    Train LoRA. Without it Train LoRA runs no pre-flight and keeps the defaults (on_oom switch,
    watchdog 1.5x)."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (GUARDRAILS,), ("guardrails",)
    OPTIONS = NodeOptions({name: name for name in ("memory_budget", "start_anyway", "on_oom", "watchdog_slowdown")})

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "memory_budget": widget("memory_budget", default="free", extra=" Empty: no pre-flight.",
                                    tooltip=api.option_named("memory_budget").help.replace(NO_PREFLIGHT, "")),
            "start_anyway": widget("start_anyway"),
            "on_oom": widget("on_oom"),
            "watchdog_slowdown": widget("watchdog_slowdown"),
        }}

    @staticmethod
    def values(inputs: dict) -> dict:
        """The node's values as the engine's options: an empty budget means no pre-flight."""
        budget = inputs.get("memory_budget")
        return {**inputs, "memory_budget": budget.strip() or None if isinstance(budget, str) else budget}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        return cls.OPTIONS.validate(cls.values(inputs))

    @public_errors
    def build(self, memory_budget, start_anyway, on_oom, watchdog_slowdown):
        inputs = {"memory_budget": memory_budget, "start_anyway": start_anyway, "on_oom": on_oom,
                  "watchdog_slowdown": watchdog_slowdown}
        self.OPTIONS.validate(self.values(inputs))
        return (self.OPTIONS.config(self.values(inputs)).guards,)
