"""The plan of a query: the effective per-block plan of a family for schedule keys, without a model.

The schedule node's block strip (``web/``) and the ``GET /segckpt/plan`` route show this; it is the
same :func:`~.plan.effective_plan` every other entry point reports, applied to the block counts of
a reference model built on the ``meta`` device (no weights are allocated and no file is read).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Mapping

import torch

from ..config.schedule import KEYS, CheckpointSchedule, ScheduleError
from ..families import family_names, get_family
from .plan import count_blocks, effective_plan

SIZES = ("full", "tiny")
"""``full``: the diffusers class's default config (the released model's block counts for most
classes); ``tiny``: the family's tiny preset."""
PARAMETERS = ("family", "size", *KEYS)


class PlanQueryError(ValueError):
    """A preview parameter is unknown or invalid; the message names the key, value and what is allowed."""


@functools.lru_cache(maxsize=None)
def reference_block_counts(family_name: str, size: str = "full") -> tuple[tuple[str, int], ...]:
    """Block count of each of the family's lists for the reference model of ``size``.

    The model is instantiated on the ``meta`` device (a few seconds at most, cached per process).
    A class whose default config does not build falls back to the tiny preset's counts.

    Raises:
        KeyError: unknown family.
    """
    family = get_family(family_name)
    config = dict(family.tiny_config) if size == "tiny" else {}
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = family.model_cls()(**config)
    except Exception:
        if size == "tiny":
            raise
        return reference_block_counts(family_name, "tiny")
    return tuple(count_blocks(family, model).items())


def plan_for_query(query: Mapping[str, str]) -> dict[str, Any]:
    """The plan for string parameters as they come from a URL query.

    Args:
        query: ``family`` (required), ``size`` (``full`` or ``tiny``, default ``full``) and any of
            the six schedule keys as strings (``""``/``none`` = unset; see
            :meth:`~..config.schedule.CheckpointSchedule.from_config`).

    Returns:
        :meth:`~.plan.ModelPlan.to_dict` plus ``size`` and ``num_blocks`` (per list).

    Raises:
        PlanQueryError: an unknown parameter, an unknown family or size, an invalid key value, or a
            schedule the family cannot run (e.g. ``torch-ffn`` without an FFN boundary).
    """
    unknown = sorted(set(query) - set(PARAMETERS))
    if unknown:
        raise PlanQueryError(f"parameter {unknown[0]}={query[unknown[0]]!r} is unknown: allowed {', '.join(PARAMETERS)}")
    name = query.get("family", "")
    if name.lower() not in family_names():
        raise PlanQueryError(f"family={name!r} is invalid: allowed {', '.join(family_names())}")
    size = query.get("size", "full")
    if size not in SIZES:
        raise PlanQueryError(f"size={size!r} is invalid: allowed {', '.join(SIZES)}")
    family = get_family(name)
    try:
        schedule = CheckpointSchedule.from_config({k: v for k, v in query.items() if k in KEYS})
        counts = dict(reference_block_counts(family.name, size))
        plan = effective_plan(family, schedule, counts, warn=False)
    except ScheduleError as exc:
        raise PlanQueryError(str(exc)) from exc
    return {**plan.to_dict(), "size": size, "num_blocks": counts}
