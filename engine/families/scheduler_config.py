"""A model folder's ``scheduler/scheduler_config.json`` read over a family's declared :class:`~.shift.FlowShift`
(the keys that shift noise levels; the rest of the file is the scheduler's business)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from .shift import FlowShift

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
"""Where a diffusers pipeline folder keeps its scheduler's config."""
TIME_SHIFT_TYPES = ("exponential", "linear")
NUMBERS = ("shift", "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")
SCHEDULER_KEYS = (*NUMBERS, "use_dynamic_shifting", "time_shift_type", "shift_terminal")
"""The scheduler config keys :class:`FlowShift` reads from a file (UniPC's and DPM-Solver's ``flow_shift``
reads as ``shift``)."""


class SchedulerConfigError(ValueError):
    """A model folder's scheduler config cannot be read; the message names the file and the key."""


def read_scheduler_config(declared: FlowShift, path: str | Path) -> FlowShift:
    """The scheduler config file ``path``: its keys over the scheduler's defaults (as ``from_config``
    builds it: the declared values fill no key the file leaves out), with ``declared``'s mu rule.

    Raises:
        SchedulerConfigError: not a JSON object, or a key of the wrong kind (named).
    """
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SchedulerConfigError(f"scheduler config {path} could not be read as JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise SchedulerConfigError(f"scheduler config {path} is not a JSON object")
    if "shift" not in values and values.get("flow_shift") is not None:
        values = {**values, "shift": values["flow_shift"]}
    read = {key: values[key] for key in SCHEDULER_KEYS if key in values}
    config = replace(FlowShift(mu_rule=declared.mu_rule, mu_steps=declared.mu_steps,
                               mu_pixels_per_token=declared.mu_pixels_per_token), **read, source=str(path))
    bad = [key for key in NUMBERS if isinstance(getattr(config, key), bool)
           or not isinstance(getattr(config, key), (int, float)) or not math.isfinite(getattr(config, key))]
    bad += ["shift"] if "shift" not in bad and not config.shift > 0 else []
    if config.time_shift_type not in TIME_SHIFT_TYPES:
        bad.append("time_shift_type")
    if not isinstance(config.use_dynamic_shifting, bool):
        bad.append("use_dynamic_shifting")
    if bad:
        raise SchedulerConfigError(f"scheduler config {path}: {bad[0]}={getattr(config, bad[0])!r} is invalid: "
                                   f"allowed numbers ({', '.join(NUMBERS)}; shift > 0), time_shift_type "
                                   f"{' or '.join(TIME_SHIFT_TYPES)}, use_dynamic_shifting true or false")
    return config


def scheduler_settings(declared: FlowShift | None, folder: str | Path) -> FlowShift | None:
    """A pipeline folder's ``scheduler/scheduler_config.json`` (:func:`read_scheduler_config`, with the mu
    rule of the family's ``declared`` config), or ``None`` when it has none (``declared`` applies).

    Raises:
        SchedulerConfigError: the file cannot be read.
    """
    path = Path(folder) / SCHEDULER_CONFIG
    return read_scheduler_config(declared or FlowShift(), path) if path.is_file() else None
