"""Training with the fit guardrails: the pre-flight verdict before step 1, out-of-memory recovery
guided by the pre-flight's probes, and the receipt after the run (``report.json`` ``preflight``
and ``receipt``). The CLI's ``train`` and the Train LoRA node call :func:`guarded_train`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..core.memory import budget_bytes
from ..core.schedule import CheckpointSchedule
from ..train.config import TrainConfig
from ..train.loop import TrainResult, load_bundle, resolve_device, train
from ..train.recovery import cheaper_schedules
from ..train.report import write_report
from .planner import predict
from .preflight import PreflightRefused, Verdict, preflight
from .receipt import build_receipt, render_receipt


def guided_next_schedule(verdict: Verdict) -> Callable[[CheckpointSchedule, Any], CheckpointSchedule | None]:
    """Out-of-memory recovery that skips rungs predicted not to fit: the first schedule of the
    ladder (:func:`~..train.recovery.cheaper_schedules`) whose predicted peak fits every probed
    shape, else the ladder's next rung."""
    def choose(schedule: CheckpointSchedule, family) -> CheckpointSchedule | None:
        ladder = cheaper_schedules(schedule, family)
        for candidate in ladder:
            if all(predict(p, candidate).peak_bytes <= verdict.budget_bytes for p in verdict.probes.values()):
                return candidate
        return ladder[0] if ladder else None
    return choose


def guarded_train(config: TrainConfig, *, bundle=None, log: Callable[[str], None] = print,
                  on_verdict: Callable[[Verdict], None] | None = None, **train_kwargs: Any) -> TrainResult:
    """:func:`~..train.loop.train` with the pre-flight (when ``config.memory_budget`` is set) and
    the receipt.

    Args:
        config: the run. bundle: the loaded model (default: loaded here when the pre-flight needs
            it, else by the run). log: where lines go.
        on_verdict: called with the verdict before training starts (a node shows it).
        train_kwargs: passed to :func:`~..train.loop.train` (``on_step``, ``should_stop``,
            ``cache_dir``, ``prepared``, ``preview_source``).

    Raises:
        PreflightRefused: a phase is predicted not to fit and ``start_anyway`` is off (nothing
            is trained or written).
        See :func:`~..train.loop.train` for the rest.
    """
    verdict = None
    if config.memory_budget is not None:
        bundle = bundle or load_bundle(config, log=log)
        budget = budget_bytes(config.memory_budget, resolve_device(config), "memory_budget")
        verdict = preflight(config, bundle, budget, prepared=train_kwargs.get("prepared"),
                            should_stop=train_kwargs.get("should_stop"))
        log(verdict.render())
        if on_verdict is not None:
            on_verdict(verdict)
        if not verdict.fits and not config.start_anyway:
            fix = (f"set the schedule it names ({verdict.suggestion.mode})" if verdict.suggestion
                   else "lower the resolution or batch size")
            raise PreflightRefused(f"{verdict.render()}\nnot started: {fix}, raise memory_budget, or start anyway "
                                   "(--start-anyway, the node's start_anyway)")
        train_kwargs["next_schedule"] = guided_next_schedule(verdict)
    result = train(config, bundle=bundle, log=log, **train_kwargs)
    if not result.writer:  # a rank other than 0 of a sharded run: rank 0 writes and prints
        return result
    receipt = build_receipt(result, verdict)
    result.report["receipt"] = receipt
    if verdict is not None:
        result.report["preflight"] = verdict.to_dict()
    write_report(result.report, Path(result.config.output))
    log(render_receipt(receipt))
    return result
