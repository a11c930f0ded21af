"""The Fit Guardrails node: the pre-flight budget, out-of-memory recovery and the slowdown watchdog
of a Train LoRA run (``engine/config/guardrails.py``; the facade's ``train`` applies them)."""

from __future__ import annotations

from ..engine import api
from .environment import public_errors
from .payloads import CATEGORY, Sockets
from .v3 import io
from .widgets import NodeOptions, widget

NO_PREFLIGHT = " Unset: no pre-flight."


class FitGuardrails(io.ComfyNode):
    """Pre-flight verdict (a memory budget), recovery from out-of-memory, and the watchdog; connect to
    Train LoRA. Without it Train LoRA runs no pre-flight and keeps the defaults (on_oom switch,
    watchdog 1.5x)."""

    OPTIONS = NodeOptions({name: name for name in ("memory_budget", "start_anyway", "on_oom", "watchdog_slowdown")})

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SegCkptFitGuardrails", display_name="Fit Guardrails (pre-flight, OOM recovery, watchdog)",
            category=CATEGORY,
            inputs=[widget("memory_budget", default="free", extra=" Empty: no pre-flight.",
                           tooltip=api.option_named("memory_budget").help.replace(NO_PREFLIGHT, "")),
                    *[widget(key) for key in ("start_anyway", "on_oom", "watchdog_slowdown")]],
            outputs=[Sockets.guardrails.Output(display_name="guardrails")])

    @staticmethod
    def values(inputs: dict) -> dict:
        """The node's values as the engine's options: an empty budget means no pre-flight."""
        budget = inputs.get("memory_budget")
        return {**inputs, "memory_budget": budget.strip() or None if isinstance(budget, str) else budget}

    @classmethod
    def validate_inputs(cls, **inputs):
        return cls.OPTIONS.validate(cls.values(inputs))

    @classmethod
    @public_errors
    def execute(cls, memory_budget, start_anyway, on_oom, watchdog_slowdown):
        inputs = {"memory_budget": memory_budget, "start_anyway": start_anyway, "on_oom": on_oom,
                  "watchdog_slowdown": watchdog_slowdown}
        cls.OPTIONS.validate(cls.values(inputs))
        return io.NodeOutput(cls.OPTIONS.config(cls.values(inputs)).guards)
