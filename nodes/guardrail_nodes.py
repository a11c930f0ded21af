"""The Fit Guardrails node: the pre-flight budget, out-of-memory recovery and the slowdown watchdog
of a Train LoRA run (engine/measure/guarded.py, engine/train/recovery.py, engine/train/watchdog.py)."""

from __future__ import annotations

from typing import Any

from ..engine.core.memory import check_budget
from ..engine.train.config import HELP
from ..engine.train.recovery import ON_OOM
from .environment import NodeError

CATEGORY = "training/gradient checkpointing"
GUARDRAILS = "SEGCKPT_GUARDRAILS"


def _tip(text: str, **spec: Any) -> dict:
    return {"tooltip": text, **spec}


class FitGuardrails:
    """Pre-flight verdict (a memory budget), recovery from out-of-memory, and the watchdog; connect to
    Train LoRA. Without it Train LoRA runs no pre-flight and keeps the defaults (on_oom switch,
    watchdog 1.5x)."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (GUARDRAILS,), ("guardrails",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "memory_budget": ("STRING", _tip(HELP["memory_budget"].replace(" Unset: no pre-flight.", "") +
                                             " Empty: no pre-flight.", default="free")),
            "start_anyway": ("BOOLEAN", _tip(HELP["start_anyway"], default=False)),
            "on_oom": (list(ON_OOM), _tip(HELP["on_oom"], default="switch")),
            "watchdog_slowdown": ("FLOAT", _tip(HELP["watchdog_slowdown"], default=1.5, min=0.0, max=100.0,
                                                step=0.1)),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, memory_budget, watchdog_slowdown):
        if memory_budget.strip():
            try:
                check_budget(memory_budget, "memory_budget")
            except ValueError as exc:
                return str(exc)
        if watchdog_slowdown and watchdog_slowdown <= 1:
            return f"watchdog_slowdown={watchdog_slowdown!r} is invalid: allowed a number > 1, or 0 (off)"
        return True

    def build(self, memory_budget, start_anyway, on_oom, watchdog_slowdown):
        if memory_budget.strip():
            try:
                check_budget(memory_budget, "memory_budget")
            except ValueError as exc:
                raise NodeError(str(exc)) from None
        return ({"memory_budget": memory_budget.strip() or None, "start_anyway": start_anyway, "on_oom": on_oom,
                 "watchdog_slowdown": watchdog_slowdown},)
