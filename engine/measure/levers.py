"""Levers the planner measures rather than predicts (``segckpt plan --levers``): keeping attention
outputs (``gradient_checkpointing_save_attention``) and per-block compile (``compile_blocks``), each
kept only when the chosen schedule measures faster with it within the budget."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..config.measure import LEVERS
from .runs import MeasurementInterrupted, RunWorkspace, peak_after_warmup

if TYPE_CHECKING:
    from .planner import PlanChoice


LEVER_GAIN = 0.02
"""A lever is kept only when it measures at least this much faster (2%: above the noise of a
paired measurement on a shared machine) with its measured peak within the budget."""


def try_levers(choice: "PlanChoice", workspace: RunWorkspace, warmup_steps: int, measure_steps: int,
               names: tuple[str, ...] = LEVERS) -> None:
    """Measure the chosen schedule with each lever of ``names`` (:data:`LEVERS`) and keep a lever
    only when it is faster within the budget, time and peak measured (never predicted: its cost
    depends on the model and the card; FastVideo PR #1410, OneTrainer #1114 and the documents'
    compile regressions): ``gradient_checkpointing_save_attention`` (checkpointed ``torch`` or
    ``unsloth`` regions), then ``compile_blocks`` over what was kept. The choice's schedule, its
    measured figures and ``compile_blocks`` (True when kept, False when tried and not kept) follow,
    so :meth:`~.planner.PlanChoice.options` holds every decision; ``notes`` say which lever was
    kept and why.
    """
    base = choice.chosen.schedule
    levers = []
    if "save_attention" in names:
        if base.gradient_checkpointing and not base.backend.ffn_scope and not base.gradient_checkpointing_save_attention:
            levers.append(("gradient_checkpointing_save_attention",
                           base.replace(gradient_checkpointing_save_attention=True), {}))
        else:
            choice.notes.append(f"gradient_checkpointing_save_attention: not tried ({base.mode} has no whole-block "
                                "region to keep attention in)")
    if "compile" in names:
        levers.append(("compile_blocks", None, {"compile_blocks": True}))
    workspace.expect(len(levers) * (warmup_steps + measure_steps))
    for name, schedule, changes in levers:
        schedule = schedule or choice.chosen.schedule
        try:
            result = workspace.run(schedule, warmup_steps, measure_steps, **changes)
        except MeasurementInterrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - a lever that fails is not kept
            choice.notes.append(f"{name}: not kept ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            _decided(choice, changes, False)
            continue
        seconds, peak = result.report["totals"]["sec_per_step"], peak_after_warmup(result, warmup_steps)
        ratio = seconds / choice.measured_sec_per_step
        figures = f"{ratio:.3f}x sec/step, peak {peak / 2**30:.4g} GiB"
        if peak > choice.budget_bytes:
            choice.notes.append(f"{name}: not kept ({figures}, over the budget)")
        elif ratio > 1 - LEVER_GAIN:
            choice.notes.append(f"{name}: not kept ({figures}: not faster by {LEVER_GAIN:.0%})")
        else:
            choice.notes.append(f"{name}: kept ({figures}, within the budget)")
            choice.measured_sec_per_step, choice.measured_peak_bytes = seconds, peak
            if not changes:
                choice.chosen = dataclasses.replace(choice.chosen, schedule=schedule)
            _decided(choice, changes, True)
            continue
        _decided(choice, changes, False)


def _decided(choice: "PlanChoice", changes: dict, kept: bool) -> None:
    """Record the ``compile`` lever's decision (``changes`` holds ``compile_blocks``) in the choice."""
    if changes:
        choice.compile_blocks = kept
