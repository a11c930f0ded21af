"""The fit guardrails of a run: the pre-flight memory budget, out-of-memory recovery, the slowdown
watchdog and the non-finite guard (read by ``engine/train/`` and ``engine/measure/preflight.py``).

A run without guardrails (``TrainConfig.guardrails = None``: the short runs of a sweep, a probe,
lockstep timing) has no pre-flight and no watchdog, and an out-of-memory error or a non-finite
value ends it: a measurement measures its own schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import ConfigError, check_options, option

ON_OOM = ("switch", "stop")
"""``on_oom`` values: ``switch`` to the next cheaper schedule and retry the step, or ``stop`` (the
last good step's LoRA and state are saved)."""
ON_NONFINITE = ("stop", "skip")
"""``on_nonfinite`` values: ``stop`` (the last good step is saved) or ``skip`` the step's update."""
BUDGET_WORDS = ("device", "fit this device", "free")
"""Budget values that name a device's memory instead of a number of GiB."""
MAX_GIB = 2**20


def check_budget(value: Any, key: str = "budget") -> float | str:
    """``value`` as a number of GiB, or one of :data:`BUDGET_WORDS` (lower case).

    Raises:
        ConfigError: neither a finite number of GiB > 0 (below 1 PiB) nor a budget word; the
            message names ``key``, the value and what is allowed.
    """
    if isinstance(value, str) and value.strip().lower() in BUDGET_WORDS:
        return value.strip().lower()
    try:
        gib = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        gib = -1.0
    if not 0 < gib < MAX_GIB:  # also refuses nan and inf
        raise ConfigError(f"{key}={value!r} is invalid: allowed a number of GiB > 0 (below 1 PiB), 'device' (its "
                          "total memory) or 'free' (its free memory now)")
    return gib


def _budget(value: Any) -> str | None:
    """``memory_budget`` as a string (``"20.0"``, ``"free"``), or unset."""
    return None if value is None else str(check_budget(value, "memory_budget"))


@dataclass(frozen=True)
class GuardrailsConfig:
    """Guardrails of a long run. Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    memory_budget: str | None = option(
        None, "Memory budget of the pre-flight check: a number of GiB, device (the device's total memory) or free "
        "(its free memory now); before step 1 one probe step per batch shape (and the preview phase) predicts every "
        "phase's peak, and a run predicted not to fit does not start (unless start_anyway). Unset: no pre-flight.",
        "--budget", parse=_budget, long_run=True)
    start_anyway: bool = option(False, "Start even when the pre-flight predicts that a phase does not fit the "
                                "memory budget.", "--start-anyway", long_run=True)
    on_oom: str = option("switch", "When a step runs out of memory: switch (keep the last completed step, apply "
                         "the next cheaper checkpoint schedule, retry the step, report the switch) or stop (keep "
                         "the last good step's LoRA and state, exit status 2).", "--on-oom", choices=ON_OOM,
                         long_run=True)
    watchdog_slowdown: float = option(1.5, "Report once when steps run this many times slower than the first "
                                      "steps after warm-up (of the same shape) for watchdog_window steps in a row, "
                                      "with the likely cause (0 = off).", "--watchdog-slowdown", above=1, max=100,
                                      off=0, step=0.1, allowed="a number > 1, or 0 (off)", long_run=True)
    watchdog_window: int = option(5, "Consecutive slow steps that make a slowdown.", "--watchdog-window", min=1,
                                  max=10**6, long_run=True)
    on_nonfinite: str = option("stop", "When the loss or a LoRA gradient is NaN/inf: stop (keep the last good "
                               "step's LoRA and state, exit status 2) or skip (drop that step's update, report "
                               "it, go on).", "--on-nonfinite", choices=ON_NONFINITE)

    def __post_init__(self) -> None:
        check_options(self)
