"""How a run is measured: the options of ``segckpt sweep``, ``segckpt plan`` (and ``plan --check``,
the pre-flight) and of the Checkpointing Sweep and Schedule Planner nodes, declared once like a
run's options (``engine/config/options.py``), so their flags, node widgets and README rows are
generated from here (read by ``engine/measure/`` through the facade's ``sweep``, ``plan`` and
``check_fit``).

The run being measured is a :class:`~.train.TrainConfig` (model, data, resolution, batch, schedule,
output folder); a :class:`MeasureConfig` says how: warm-up and measured steps, which modes a sweep
runs, the plan's budgets, timing steps and levers, frame counts and processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .guardrails import check_budget
from .options import ConfigError, check_options, option, options_of

LEVERS = ("save_attention", "compile")
"""What ``plan --levers`` can try (``engine/measure/planning.py`` ``try_levers``): ``gradient_checkpointing_save_attention``
and ``compile_blocks``, each kept only when measured faster within the budget."""
MAX_STEPS = 1000
"""The most measured steps per mode (the nodes' widgets have always allowed this many)."""
BUDGET_ALLOWED = "a number of GiB > 0 (below 1 PiB), device or free"
"""What a budget option allows (``engine/config/guardrails.py`` ``check_budget``)."""
OUTPUTS = {"sweep": "output/sweep", "plan": "output/plan"}
"""Each measurement's output folder when ``output`` is not given (``segckpt sweep``, ``segckpt plan``)."""


def _budget(key: str):
    """A budget option's parse: a number of GiB, ``device`` or ``free``, kept as a string; or unset."""
    def parse(value: Any) -> str | None:
        return None if value is None else str(check_budget(value, key))
    return parse


def _levers(value: Any) -> tuple[str, ...]:
    """``levers``: one or more of :data:`LEVERS` (a string is one lever), in the order given, once each."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n in LEVERS for n in names):
        raise ConfigError(f"levers={value!r} is invalid: allowed one or more of {', '.join(LEVERS)}, or none.")
    return tuple(dict.fromkeys(names))


def _frames(value: Any) -> tuple[int, ...] | None:
    """``frames``: one or more pixel-frame counts (integers >= 1; the command line gives them as
    strings), in the order given, once each; or unset. The family's frame rule is checked where the
    model is known (``engine/measure/frames.py`` ``check_measure_frames``)."""
    if value is None:
        return None
    counts = (value,) if isinstance(value, (int, str)) else value
    try:
        numbers = tuple(int(n) if isinstance(n, str) and n.strip().isdigit() else n for n in counts)
    except TypeError:
        numbers = ()
    if not numbers or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 for n in numbers):
        raise ConfigError(f"frames={value!r} is invalid: allowed one or more pixel-frame counts (integers from 1 to "
                          "1024; the family's frame rule applies), or unset.")
    return tuple(dict.fromkeys(numbers))


@dataclass(frozen=True)
class SweepSettings:
    """What ``segckpt sweep`` and the Checkpointing Sweep node measure. Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    measured_steps: int = option(3, "Sweep: measured steps per mode after the warm-up.", "--measure", min=1,
                                 max=MAX_STEPS)
    attention_offload: bool = option(True, "Sweep: also measure every mode with attention offload (doubles the "
                                     "sweep; off halves it).",
                                     "--no-attention-offload")
    save_attention: bool = option(False, "Sweep: add every checkpointed torch and unsloth mode keeping its "
                                  "attention outputs (-save-attn columns: gradient_checkpointing_save_attention).",
                                  "--save-attention")
    streaming: bool = option(False, "Sweep: add the four base modes with every block's frozen weights streamed "
                             "from host memory (weight H2D GiB/step and stall % columns).", "--stream")
    compile: bool = option(False, "Sweep: measure every mode again with compile_blocks (+compile columns; compile "
                           "time is in the warm-up steps, so give 2 or more warm-up steps).", "--compile")
    budget_gib: float = option(0.0, "Sweep: memory budget drawn as a line on the plot, GiB (0 = none).",
                               "--budget-gib", min=0.0, max=4096.0, step=0.0001,
                               allowed="a number of GiB from 0 to 4096 (0: none)")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class PlanSettings:
    """What ``segckpt plan`` (and ``plan --check``) and the Schedule Planner node plan for.
    Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    budget: str | None = option(None, "Plan: memory budget in GiB, device (this device's total memory) or free "
                                "(its free memory now); required.", "--budget", parse=_budget("budget"),
                                allowed=BUDGET_ALLOWED)
    host_budget: str | None = option(None, "Plan: host memory for streamed weights and offloaded activations, GiB, "
                                     "free (the host's available memory now) or device (its total memory); unset: "
                                     "the available memory less 10%.", "--host-budget",
                                     parse=_budget("host_budget"), allowed=BUDGET_ALLOWED + ", or unset")
    timing_steps: int = option(3, "Plan: steps to time the chosen prediction and up to 2 other fitting ones in "
                               "lockstep (one step of each in turn) before deciding; 0 = predict only.", "--measure",
                               min=0, max=MAX_STEPS)
    levers: tuple[str, ...] = option((), "Plan: after the choice is measured, measure it with each lever "
                                     "(save_attention: gradient_checkpointing_save_attention; compile: compile_blocks) "
                                     "and keep one only when it is faster within the budget; the plan says which and "
                                     "why, and schedule.json holds what was kept.", "--levers", choices=LEVERS,
                                     parse=_levers)
    preflight: bool = option(False, "Plan: the pre-flight instead: judge the given schedule against the budget in "
                             "every phase (each batch shape, the previews) and name the schedule that would fit; "
                             "exit status 0 when it fits, 1 when it does not.", "--check")
    nproc: int = option(1, "Plan: processes (GPUs) the run will use under torchrun: also predict the choice's "
                        "per-rank peak under DDP and FSDP2 and recommend DDP when a replica fits the budget, FSDP2 "
                        "otherwise, then choosing the schedule by FSDP2's per-rank peak (nproc.json).", "--nproc",
                        min=1, max=1024)

    def __post_init__(self) -> None:
        check_options(self)
        if self.preflight and self.nproc > 1:
            raise ConfigError(f"nproc={self.nproc} is invalid with preflight=True (--check): allowed 1 (the "
                              "pre-flight judges one process).")


@dataclass(frozen=True)
class MeasureConfig:
    """How a run is measured: the options shared by every measurement, a sweep's and a plan's.
    Validated at construction (each component checks itself).

    Build one from flat keys with :meth:`create`; :meth:`to_dict` gives them back.

    Raises:
        ConfigError: a field is out of range, or an unknown key (the message names the key, the
            value and what is allowed).
    """

    warmup_steps: int = option(1, "Steps per measured run before its measured ones (excluded from sec/step and "
                               "peak: step 1 also allocates the optimizer state, and compiles).", "--warmup", min=1,
                               max=100)
    frames: tuple[int, ...] | None = option(None, "Pixel-frame counts to measure (video families; the family's frame "
                                            "rule applies, e.g. Wan 4k+1), on synthetic latents (N, C, F', h, w) of "
                                            "the run's resolution: a sweep writes one table per count into "
                                            "<output>/frames-N/; a plan predicts per count and chooses a schedule "
                                            "that fits every count; plan --check judges one phase per count.",
                                            "--frames", parse=_frames,
                                            allowed="pixel-frame counts from 1 to 1024, or unset")
    sweep: SweepSettings = field(default_factory=SweepSettings)
    plan: PlanSettings = field(default_factory=PlanSettings)

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def create(cls, **values: Any) -> "MeasureConfig":
        """The defaults with some flat keys set: ``MeasureConfig.create(budget="device", timing_steps=1)``.

        Raises:
            ConfigError: an unknown key; see the class for invalid values.
        """
        return cls().replace(**values)

    def replace(self, **values: Any) -> "MeasureConfig":
        """A validated copy with some flat keys changed.

        Raises:
            ConfigError: an unknown key; see the class for invalid values.
        """
        by_key = {opt.key: opt for opt in MEASURE_OPTIONS}
        changes: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            if key not in by_key:
                raise ConfigError(f"{key}={value!r} is invalid: allowed the measurement keys of segckpt options "
                                  f"({', '.join(by_key)}).")
            path = by_key[key].path
            changes.setdefault(path[0] if len(path) > 1 else "", {})[path[-1]] = value
        root = changes.pop("", {})
        for group, fields_ in changes.items():
            root[group] = dataclasses.replace(getattr(self, group), **fields_)
        return dataclasses.replace(self, **root)

    def to_dict(self) -> dict[str, Any]:
        """Every option by its flat key (JSON-ready but for tuples)."""
        values = {}
        for opt in MEASURE_OPTIONS:
            value: Any = self
            for name in opt.path:
                value = getattr(value, name)
            values[opt.key] = value
        return values


MEASURE_OPTIONS = tuple(options_of(MeasureConfig))
"""Every option of a measurement, in the tree's order: one flat key each (see :class:`~.options.Option`)."""
