"""The Fit Guardrails node: the pre-flight budget, out-of-memory recovery and the slowdown watchdog
of a Train LoRA run (``engine/config/guardrails.py``; the facade's ``train`` applies them)."""

from __future__ import annotations

from ..engine import api
from .environment import NodeError
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
    def guardrails(**inputs) -> api.GuardrailsConfig:
        """The engine's guardrails of the node's values (an empty budget: no pre-flight).

        Raises:
            ConfigError: a value the engine refuses, named (the config's own validator).
        """
        budget = inputs.get("memory_budget")
        values = {**inputs, "memory_budget": budget.strip() or None if isinstance(budget, str) else budget}
        return FitGuardrails.OPTIONS.config(values).guards

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        try:
            cls.guardrails(**inputs)
        except ValueError as exc:
            raise NodeError(str(exc)) from None
        return True

    def build(self, memory_budget, start_anyway, on_oom, watchdog_slowdown):
        try:
            return (self.guardrails(memory_budget=memory_budget, start_anyway=start_anyway, on_oom=on_oom,
                                    watchdog_slowdown=watchdog_slowdown),)
        except ValueError as exc:
            raise NodeError(str(exc)) from None
