"""The files a run writes into its output folder: the LoRA, the resumable state and
``report.json`` (each atomic), and :class:`TrainResult`, what a finished run hands back."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TrainConfig
from ..core.plan import ModelPlan
from ..files.atomic import OutputWriteError, remove_stale_temporaries
from ..model.distributed import full_optimizer_state
from ..model.lora_files import LoraWeights, lora_paths, lora_state_dict, save_lora_files
from .optim import optimizer_class
from .report import REPORT_FILE, build_report, write_report
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

    def save_state(self, ctx, config: TrainConfig, history: list[dict[str, Any]], rng: dict[str, torch.Tensor],
                   position: dict[str, int], step: int, sharded: bool, processes: int = 1) -> None:
        """Write the resumable state after ``step`` steps (sharded: the optimizer state gathered
        whole by every rank, written by rank 0); its config records the ``processes`` that shared
        each batch (a resume checks the global batch: ``engine/train/checks.py``)."""
        lora, optimizer = lora_state_dict(ctx.model), ctx.optimizer.state_dict()
        if sharded:
            optimizer = full_optimizer_state(optimizer)
        if self.writer:
            try:
                save_state(TrainingState(step, position, lora, optimizer, rng, history,
                                         {**config.to_dict(), "processes": processes}, ctx.scaler.state_dict(),
                                         self.inputs, optimizer_class(ctx.optimizer)), self.output)
            except OutputWriteError as exc:
                raise self._failed(exc) from exc
        self.saved_step = step

    def write(self, ctx, config: TrainConfig, plan: ModelPlan, history: list[dict[str, Any]], source: str,
              sections: dict[str, Any], interrupted: bool, save_state: Callable[[], None] | None = None,
              start_step: int = 0) -> tuple[Path, dict[str, Any]]:
        """Save the LoRA (its header: family, schedule, steps, base model), then the state
        (``save_state``, when given) and ``report.json`` (:func:`~.report.build_report` with the
        run's ``sections``); ``(LoRA path, report)``. A resume that trained nothing (its history
        ends at ``start_step``) keeps the LoRA the folder holds: it is that step's.

        Raises:
            OutputWriteError: a file could not be written; the message names it, the last saved
                state that is intact and the LoRA already written.
        """
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
        report = build_report(config, plan, history, ctx.timer, ctx.device, source, interrupted, sections, start_step)
        if self.writer:
            try:
                write_report(report, self.output)
            except OutputWriteError as exc:
                raise self._failed(exc) from exc
        return lora_path, report
