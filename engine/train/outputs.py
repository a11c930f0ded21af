"""The files a run writes into its output folder: the LoRA, the resumable state and
``report.json`` (each atomic), and :class:`TrainResult`, what a finished run hands back."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TrainConfig
from ..core.plan import ModelPlan
from ..data.prepare import RunData
from ..files.atomic import OutputWriteError, remove_stale_temporaries
from ..model.distributed import full_optimizer_state
from ..model.lora_files import LoraWeights, lora_paths, lora_state_dict, save_lora_files
from ..model.precision import BaseWeights
from .optim import optimizer_class
from .report import REPORT_FILE, build_report, memory_section, recipe_section, write_report
from .state import STATE_FILE, TrainingState, save_state

LORA_FILE = "lora.safetensors"


@dataclass
class TrainResult:
    """What a run produced: the plan it applied, per-step records and the files written."""

    config: TrainConfig
    plan: ModelPlan
    history: list[dict[str, Any]]
    lora_path: Path
    state_path: Path
    report_path: Path
    report: dict[str, Any]
    interrupted: bool = False
    model: Any = field(default=None, repr=False)
    writer: bool = True
    """False on the ranks of a sharded run other than 0 (they wrote nothing)."""
    resumed_at: int = 0
    """The step this run started at (a resume's saved step; 0 for a fresh run)."""
    lora: LoraWeights | None = field(default=None, repr=False)
    """The trained LoRA without its model (:meth:`without_model`); None while ``model`` holds it."""

    def without_model(self) -> TrainResult:
        """This result with the trained LoRA as :class:`~..model.lora_files.LoraWeights` (CPU tensors)
        instead of the trained model copy, whose frozen weights, runner and host buffers are then
        released: what a long-lived server keeps (issue 34). Saving takes either
        (:meth:`lora_source`)."""
        if self.model is None:
            return self
        return replace(self, model=None, lora=LoraWeights.of(self.model))

    @property
    def lora_source(self) -> Any:
        """What ``save_lora_files`` saves: the trained model, or its LoRA weights once detached."""
        return self.model if self.model is not None else self.lora

    @property
    def trained_steps(self) -> int:
        """The steps this run trained (0 for a resume with nothing left: its LoRA is unchanged)."""
        return len(self.history) - self.resumed_at


class RunFiles:
    """The output folder of one run.

    Args:
        output: the folder. writer: whether this process writes (one process, or rank 0 of a
            sharded run; the other ranks gather with it and write nothing).
    """

    def __init__(self, output: Path, writer: bool):
        self.output, self.writer = output, writer
        self.lora, self.state, self.report = output / LORA_FILE, output / STATE_FILE, output / REPORT_FILE
        self.inputs: dict[str, Any] = {}
        """The fingerprint of the run's data and model, saved with the state (``engine/data/fingerprint.py``)."""
        self.saved_step: int | None = None
        """The step of the last state this run saved or resumed from (None: none yet)."""
        self._lora_step: int | None = None
        self._lora_files: list[Path] = []

    def _failed(self, exc: OutputWriteError) -> OutputWriteError:
        """``exc`` with what is still safe: the last saved state (and a LoRA written before it)."""
        kept = (f"the last saved state (step {self.saved_step}, {self.state}) is intact and resumes with --resume"
                if self.saved_step is not None else "no state of this run was saved before")
        if self._lora_step is not None:
            kept += f"; the LoRA of step {self._lora_step} is saved in {', '.join(map(str, self._lora_files))}"
        return OutputWriteError(f"{exc}; {kept}")

    def remove_stale(self) -> None:
        """Delete temporaries left by a process killed while writing."""
        if self.writer:
            remove_stale_temporaries(self.output)

    def save_state(self, ctx, history: list[dict[str, Any]], rng: dict[str, torch.Tensor], position: dict[str, int],
                   step: int) -> None:
        """Write the resumable state of ``ctx``'s run after ``step`` steps (sharded: the optimizer state
        gathered whole by every rank, written by rank 0); its config records the processes that shared
        each batch (a resume checks the global batch: ``engine/train/checks.py``)."""
        lora, optimizer = lora_state_dict(ctx.model), ctx.optimizer.state_dict()
        if ctx.dist is not None and ctx.dist.kind == "fsdp":  # a ddp rank holds the whole state
            optimizer = full_optimizer_state(optimizer)
        processes = ctx.dist.world_size if ctx.dist is not None else 1
        if self.writer:
            try:
                save_state(TrainingState(step, position, lora, optimizer, rng, history,
                                         {**ctx.config.to_dict(), "processes": processes}, ctx.scaler.state_dict(),
                                         self.inputs, optimizer_class(ctx.optimizer)), self.output)
            except OutputWriteError as exc:
                raise self._failed(exc) from exc
        self.saved_step = step

    def write(self, ctx, history: list[dict[str, Any]], source: str, sections: dict[str, Any], interrupted: bool,
              save_state: Callable[[], None] | None = None, start_step: int = 0) -> tuple[Path, dict[str, Any]]:
        """Save the LoRA of ``ctx``'s run (its header: family, schedule, steps, base model), then the state
        (``save_state``, when given) and ``report.json`` (:func:`~.report.build_report` with the
        run's ``sections``); ``(LoRA path, report)``. A resume that trained nothing (its history
        ends at ``start_step``) keeps the LoRA the folder holds: it is that step's.

        Raises:
            OutputWriteError: a file could not be written; the message names it, the last saved
                state that is intact and the LoRA already written.
        """
        config = ctx.config
        meta = {"family": ctx.family.name, "schedule": config.schedule.to_dict(), "steps": len(history),
                "base_model": source}
        try:
            unchanged = start_step > 0 and len(history) == start_step and self.lora.is_file()
            if unchanged:  # a resume with nothing left: the files of the earlier run are this LoRA
                files = {fmt: p for fmt, p in lora_paths(self.lora, config.outputs.lora_format, ctx.family.name).items()
                         if p.is_file()}
            else:
                files = save_lora_files(ctx.model, self.lora, config.lora, ctx.family.name, config.outputs.lora_format,
                                        meta, write=self.writer)
            lora_path = files.get("diffusers", files.get("comfyui", self.lora))
            sections = {**sections, "lora_files": {fmt: str(p) for fmt, p in files.items()}}
        except OutputWriteError as exc:
            raise self._failed(exc) from exc
        self._lora_step, self._lora_files = len(history), list(files.values())
        if save_state is not None:
            save_state()
        report = build_report(ctx, history, source, interrupted, sections, start_step)
        if self.writer:
            try:
                write_report(report, self.output)
            except OutputWriteError as exc:
                raise self._failed(exc) from exc
        return lora_path, report


@dataclass
class RunFacts:
    """What a run learns of itself for ``report.json`` besides its steps.

    Attributes:
        switches: the out-of-memory recoveries so far (``schedule_switches``).
        data_change: a resume's changed data continued with a fresh epoch (``on_data_change=new_epoch``):
            ``{"changes", "step", "fresh_epoch"}``; None otherwise.
        device_free: the device's free bytes before the run took any (CUDA; None on the CPU).
        base: what the base's precision did (frozen bytes, quantized layers), once built.
    """

    switches: list[dict[str, Any]] = field(default_factory=list)
    data_change: dict[str, Any] | None = None
    device_free: int | None = None
    base: BaseWeights | None = None


MEMORY_SCOPE = {"fsdp": "rank 0 (each process holds its shard of the weights)",
                "ddp": "rank 0 (each process holds a whole replica)"}
"""``report.json`` ``distributed.memory_scope``: what rank 0's memory figures stand for."""


def run_sections(ctx, facts: RunFacts, data: RunData | None, kernels: tuple[str, ...], monitor,
                 history: list[dict[str, Any]]) -> dict[str, Any]:
    """``report.json``'s sections of what the run knows of itself (:func:`~.report.build_report`'s
    ``setup``): ``ctx`` the run's :class:`~.step.StepContext`, ``monitor`` its
    :class:`~.monitor.StepMonitor`, ``data`` its prepared data (None before it was prepared)."""
    config, dist, change = ctx.config, ctx.dist, facts.data_change
    summary = data.summary if data is not None else {}
    return {"schedule_switches": facts.switches, "watchdog": monitor.watchdog.reports,
            "precision": {**ctx.precision.to_dict(), "linear_layers": facts.base.linear_layers,
                          "quantized_linear_layers": facts.base.quantized_linear_layers},
            "attention_backend": list(kernels), "optimizer": {"name": config.optimizer.name,
                                                               "class": optimizer_class(ctx.optimizer)},
            "recipe": recipe_section(config.objective, config.optimizer, config.lora, config.data.caption_dropout,
                                     ctx.noise, history, optimizer_class(ctx.optimizer)),
            "memory": memory_section(ctx, facts.base, monitor.validation_peak, facts.device_free),
            "dataset": _with_windows(summary, data.random_windows if data is not None else None),
            "text_encoder": data.text_encoder if data is not None else None,
            "compile": ctx.compiled.section(history) if ctx.compiled else None,
            "resume": change and {"data_changed": change["changes"], "from_step": change["step"],
                                  "fresh_epoch": change["fresh_epoch"]},
            "distributed": dist and {**dist.to_dict(), dist.kind: True, "checkpointing": ctx.runner.plan.applied_by,
                                     **dict(zip(("images_per_process", "global_batch"),
                                                config.data.batch_rows(dist.world_size))),
                                     "memory_scope": MEMORY_SCOPE[dist.kind]}}


def _with_windows(summary: dict[str, Any], windows: Any) -> dict[str, Any]:
    """The data summary with the random windows encoded when drawn (``dataset.frames.windows_encoded``)."""
    if windows is None or "frames" not in summary:
        return summary
    return {**summary, "frames": {**summary["frames"], "windows_encoded": windows.encoded}}
