"""Checkpointing sweep: measure every mode on the user's own model and fill the documents' matrix.

For one model, dataset shape and batch, each mode (none, layer, interval 2, interval 2 stride 4;
each with the backends and attention offload the family supports) trains for a few steps after
warm-up through the same :class:`~..train.loop.TrainingRun` as a real run, on a fresh copy of the
model.
Each cell is written in the documents' format (docs/SCHEDULES.md "Benchmark protocol":
"sec/step / peak GiB"):

* ``ok``: ``0.412 / 3.21`` (median sec/step after warm-up / largest peak of the steps after
  warm-up in GiB: the first step also allocates the optimizer state, once);
* ``OOM``: the accelerator ran out of memory (caught; memory is freed and the next cell runs);
* ``failed``: the cell did not reach its measured steps (the error message is kept);
* ``unsupported``: the family has no boundary for that backend/option (not wired);
* ``not run``: excluded by the caller.

A mode whose effective per-block plan equals an earlier mode's (:meth:`~..core.plan.ModelPlan.effect`
of the plan the run applied, fallbacks included; for a mode not measured, the plan it would apply)
is flagged "option may not have taken effect", naming the modes it equals; measured numbers never
decide it (at tiny sizes unrelated modes measure within noise of each other). Each plan note is
said once per sweep (log and table), not once per mode. Outputs: markdown, CSV, JSON and a PNG plot
(peak memory against sec/step, one point per measured mode, labels that never overlap, the budget
as a line).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config.backends import BACKENDS, DEFAULT
from ..config.measure import MeasureConfig
from ..config.schedule import CheckpointSchedule, ScheduleError, check_supported
from ..core.plan import ModelPlan, count_blocks, effective_plan
from ..families import get_family
from ..files.atomic import atomic_write_bytes, atomic_write_text
from ..train.recovery import OutOfMemoryStop, is_out_of_memory
from .frames import frames_label, use_frames
from .plots import sweep_plot_png
from .runs import MeasurementInterrupted, Progress, RunWorkspace, peak_after_warmup

BASE_MODES = {
    "none": CheckpointSchedule(gradient_checkpointing=False),
    "layer": CheckpointSchedule(),
    "interval2": CheckpointSchedule(gradient_checkpointing_interval=2),
    "interval2-stride4": CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4),
}
"""The documents' four schedules (docs/SCHEDULES.md "Benchmark protocol")."""
STATUSES = ("ok", "OOM", "failed", "unsupported", "not run")
NO_EFFECT = "option may not have taken effect"


def sweep_schedules(offload_attention: bool = True, streaming: bool = False,
                    save_attention: bool = False) -> list[CheckpointSchedule]:
    """Every mode of the sweep: the four base schedules x the four backends (checkpointed
    schedules only) x attention offload off/on; then (``save_attention``) each checkpointed
    schedule of the ``torch`` and ``unsloth`` backends keeping its attention outputs
    (``-save-attn``); then (``streaming``) the four base schedules with every block's frozen
    weights streamed (``-stream``)."""
    schedules = []
    for name, base in BASE_MODES.items():
        backends = (DEFAULT.name,) if name == "none" else BACKENDS
        for backend in backends:
            for attention in (False, True) if offload_attention else (False,):
                schedules.append(base.replace(gradient_checkpointing_backend=backend,
                                              gradient_checkpointing_offload_attention=attention))
    if save_attention:
        schedules += [s.replace(gradient_checkpointing_save_attention=True) for s in list(schedules)
                      if s.gradient_checkpointing and not s.backend.ffn_scope
                      and not s.gradient_checkpointing_offload_attention]
    if streaming:
        schedules += [base.replace(weight_offload="stream") for base in BASE_MODES.values()]
    return schedules


@dataclass
class SweepCell:
    """One measured (or skipped) mode.

    Attributes:
        mode: the schedule's short name (``interval2-stride4-unsloth-offload-attn``).
        schedule: the schedule's keys.
        status: one of :data:`STATUSES`.
        sec_per_step: median seconds per optimizer step after warm-up (``ok`` only).
        peak_bytes: the largest device peak of the steps after warm-up, bytes (``ok`` only; on
            the CPU too it counts the weights the "device" holds).
        weight_h2d_bytes: frozen-weight bytes streamed host-to-device per step (median after
            warm-up; 0 without streaming). stall_share: the share of the step compute waited on
            those copies.
        block_map: the plan the run applied (per list, see ``plan.LEGEND``).
        error: the error message of ``OOM`` / ``failed`` / ``unsupported`` cells.
        flags: notes such as "option may not have taken effect" (:func:`flag_ineffective`).
        notes: the notes of the plan the run applied (``ok`` cells; said once per sweep in the
            log and under the table).
    """

    mode: str
    schedule: dict[str, Any]
    status: str
    sec_per_step: float | None = None
    peak_bytes: int | None = None
    weight_h2d_bytes: int = 0
    stall_share: float = 0.0
    block_map: dict[str, str] = field(default_factory=dict)
    error: str = ""
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The documents' cell format: ``sec/step / peak GiB`` or the status."""
        if self.status != "ok":
            return self.status
        return f"{self.sec_per_step:.3f} / {self.peak_bytes / 2**30:.4g}"


def _supported(family, schedule: CheckpointSchedule) -> bool:
    try:
        check_supported(family, schedule)
    except ScheduleError:
        return False
    return True


def _is_oom(exc: BaseException) -> bool:
    return is_out_of_memory(exc) or isinstance(exc, OutOfMemoryStop)


def _free_memory(failed: bool) -> None:
    """Free what a cell held before the next one. A finished run's model copy goes by reference
    counting (tests/measure/test_sweep.py checks it with the collector off); a failed one's may be
    held in its traceback's cycles, and on CUDA a copy left over would count in the next cell's
    ``max_memory_allocated``: then the cyclic collector runs (a full pass over a process that has
    imported diffusers takes about 0.3 s on a CPU; the CPU tracker counts only what a step allocates)."""
    if failed or torch.cuda.is_available():
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def modes_of(measure: MeasureConfig) -> list[CheckpointSchedule]:
    """The schedules a sweep of ``measure`` runs (:func:`sweep_schedules` of its ``sweep`` settings)."""
    modes = measure.sweep
    return sweep_schedules(modes.attention_offload, modes.streaming, modes.save_attention)


def _runs(schedules: list[CheckpointSchedule], compile_modes: bool) -> list[tuple[CheckpointSchedule, dict]]:
    """Each schedule with no other setting, then (``compile_modes``) each again with ``compile_blocks``."""
    return [(s, {}) for s in schedules] + ([(s, {"compile_blocks": True}) for s in schedules] if compile_modes else [])


def _mode(schedule: CheckpointSchedule, changes: dict) -> str:
    return schedule.mode + ("+compile" if changes else "")


def run_sweep(workspace: RunWorkspace, measure: MeasureConfig | None = None, progress: Progress | None = None, *,
              schedules: list[CheckpointSchedule] | None = None,
              skip: Callable[[CheckpointSchedule], bool] | None = None, frames: int | None = None) -> list[SweepCell]:
    """Measure each schedule on a fresh copy of the workspace's model.

    Args:
        workspace: not open (:class:`~.runs.RunWorkspace`, opened here once: the cells share it, so
            the data is encoded once): the run settings shared by every cell (data, resolution,
            batch, lr, seed, device; its schedule, steps, output and resume are replaced per cell),
            the loaded model (never changed: each cell trains a deep copy), the run maker (tests
            inject faults), ``on_step`` and ``should_stop``.
        measure: warm-up and measured steps per cell, the modes (default :func:`modes_of` it)
            and, with ``compile``, each mode again with ``compile_blocks`` (mode ``<mode>+compile``;
            ``engine/core/compiling.py``). Default: :class:`~..config.measure.MeasureConfig`'s defaults.
        progress: ``log`` (a line per cell) and ``on_cell``, called after every cell with every
            cell so far and the rest as ``not run`` (write the tables there, and an interrupted
            sweep keeps what it measured).
        schedules: modes to run instead of ``measure``'s.
        skip: schedules for which it returns True are ``not run``.
        frames: measure clips of this many pixel frames (synthetic latents ``(N, C, F', h, w)``
            with the text of the run's data, :func:`~.frames.use_frames`); checked by the caller
            (:func:`~.frames.check_measure_frames`). None: the run's own data.

    Returns:
        One :class:`SweepCell` per schedule, in order, with flags set (:func:`flag_ineffective`).

    Raises:
        MeasurementInterrupted: ``should_stop`` answered True.
    """
    measure, progress = measure or MeasureConfig(), progress or Progress()
    family = get_family(workspace.bundle.family.name)
    runs = _runs(schedules or modes_of(measure), measure.sweep.compile)
    cells = _Cells(family, count_blocks(family, workspace.bundle.transformer), runs, progress)
    with workspace, (use_frames(workspace, frames) if frames is not None else contextlib.nullcontext()):
        workspace.expect((measure.warmup_steps + measure.sweep.measured_steps) * sum(
            1 for s, _ in runs if not (skip is not None and skip(s)) and _supported(family, s)))
        for schedule, changes in runs:
            cells.add(*_cell(workspace, cells, schedule, changes, skip, measure), changes)
    return cells.cells


class _Cells:
    """A sweep's cells so far, the plans they ran and the notes said: each cell logged, flagged and
    passed on as it ends."""

    def __init__(self, family, counts: dict[str, int], runs: list, progress: Progress):
        self.family, self.counts, self.runs, self.progress = family, counts, runs, progress
        self.cells: list[SweepCell] = []
        self.plans: list[tuple | None] = []  # per cell: what its plan does, and its other settings
        self.said: set[str] = set()

    def add(self, cell: SweepCell, plan: ModelPlan | None, changes: dict) -> None:
        log = self.progress.log
        log(f"sweep {cell.mode:<40} {cell.text()}" + (f"  ({cell.error.splitlines()[0]})" if cell.error else ""))
        for note in (n for n in cell.notes if n not in self.said):  # a plan's note once per sweep
            self.said.add(note)
            log(f"sweep note: {note}")
        self.cells.append(cell)
        self.plans.append(None if plan is None else (plan.effect(), tuple(sorted(changes.items()))))
        flag_ineffective(self.cells, self.plans)
        if self.progress.on_cell is not None:
            self.progress.on_cell(self.cells + [SweepCell(_mode(s, c), s.to_dict(), "not run")
                                                for s, c in self.runs[len(self.cells):]])


def _cell(workspace: RunWorkspace, cells: _Cells, schedule: CheckpointSchedule, changes: dict,
          skip: Callable[[CheckpointSchedule], bool] | None, measure: MeasureConfig) -> tuple[SweepCell, ModelPlan | None]:
    """One cell: measured, or marked ``not run`` / ``unsupported``; with the plan it ran (or would)."""
    cell = SweepCell(_mode(schedule, changes), schedule.to_dict(), "ok")
    if skip is not None and skip(schedule):
        cell.status = "not run"
    else:
        try:
            check_supported(cells.family, schedule)
        except ScheduleError as exc:
            cell.status, cell.error = "unsupported", str(exc)
    plan = _measure(cell, workspace, schedule, measure.warmup_steps, measure.sweep.measured_steps, changes) \
        if cell.status == "ok" else None
    if plan is None and cell.status != "unsupported":  # the plan it would apply
        plan = effective_plan(cells.family, schedule, cells.counts, warn=False)
    return cell, plan


class SweepInterrupted(MeasurementInterrupted):
    """A sweep was interrupted (``should_stop``, or Ctrl-C): its tables, written after every cell,
    hold the cells measured so far and the rest as ``not run``; the message says how many."""


@dataclass
class SweepTable:
    """One sweep's results as written: its cells, its folder and the files in it (see
    :func:`write_outputs`); ``measured_at``: what it trained on (a frame count), or ``""``."""

    folder: Path
    cells: list[SweepCell] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)
    measured_at: str = ""


def sweep_tables(workspace: RunWorkspace, measure: MeasureConfig, progress: Progress | None = None) -> list[SweepTable]:
    """:func:`run_sweep` in ``workspace`` (not open) on the run's data, or once per frame count of
    ``measure.frames`` (checked by the caller; the workspace opened afresh for each), each writing
    its tables (:func:`write_outputs`) after every cell into the run's output folder (``frames-N/``
    in it per count), and its plot when it ends or is interrupted.

    Raises:
        SweepInterrupted: ``should_stop`` answered True, or Ctrl-C; what was measured is written.
    """
    progress = progress or Progress()
    budget = int(measure.sweep.budget_gib * 2**30) or None
    config, bundle = workspace.config, workspace.bundle
    root, tables = Path(config.outputs.output), []
    for n in measure.frames or (None,):
        table = SweepTable(root if n is None else root / f"frames-{n}",
                           measured_at=frames_label(config.data.resolution, bundle, n) if n is not None else "")

        def write(cells: list[SweepCell], table: SweepTable = table, plot: bool = False) -> None:
            table.cells = cells
            table.paths = write_outputs(cells, table.folder, bundle.family.name, budget, table.measured_at, plot)

        try:
            run_sweep(workspace, measure, dataclasses.replace(progress, on_cell=write), frames=n)
        except (MeasurementInterrupted, KeyboardInterrupt) as exc:
            done = sum(1 for c in table.cells if c.status != "not run" or c.error)
            modes = len(_runs(modes_of(measure), measure.sweep.compile))
            raise SweepInterrupted(f"interrupted{f' at {n} frames' if n is not None else ''}: {done} of {modes} "
                                   f"modes measured; {table.folder}/sweep.md and the other tables hold them, the "
                                   "rest marked not run") from exc
        finally:  # the plot of what was measured, however the sweep ended
            if table.cells:
                write(table.cells, plot=True)
        tables.append(table)
    return tables


def _measure(cell: SweepCell, workspace: RunWorkspace, schedule: CheckpointSchedule, warmup_steps: int,
             measured_steps: int, changes: dict | None = None) -> ModelPlan | None:
    """Run one cell and fill in its figures; the plan the run applied (None when it did not finish)."""
    failed = True
    try:
        result = workspace.run(schedule, warmup_steps, measured_steps, **(changes or {}))
        failed = False
    except MeasurementInterrupted:  # Cancel stops the sweep; nothing else does
        raise
    except Exception as exc:  # a cell never stops the sweep
        cell.status = "OOM" if _is_oom(exc) else "failed"
        cell.error = f"{type(exc).__name__}: {exc}"
        return None
    finally:
        _free_memory(failed)
    totals = result.report["totals"]
    if totals["steps"] < warmup_steps + measured_steps or totals["sec_per_step"] is None:
        cell.status, cell.error = "failed", f"reached {totals['steps']} of {warmup_steps + measured_steps} steps"
        return None
    # post-warm-up figures: step 1 also allocates the optimizer state once
    cell.sec_per_step = totals["sec_per_step"]
    cell.peak_bytes = peak_after_warmup(result, warmup_steps)
    after = result.history[warmup_steps:]
    cell.weight_h2d_bytes = int(statistics.median(h.get("weight_h2d_bytes", 0) for h in after))
    cell.stall_share = round(statistics.median(h.get("weight_stall_s", 0.0) / h["seconds"] for h in after), 4)
    cell.block_map = result.plan.block_maps()
    cell.notes = list(result.plan.notes)
    return result.plan


def flag_ineffective(cells: list[SweepCell], plans: list[Any]) -> None:
    """Flag every cell whose plan equals an earlier cell's: its options may not have taken effect.

    Args:
        cells: the sweep's cells, in order (simpler modes first: :func:`sweep_schedules`).
        plans: per cell, a hashable value of what it runs (:meth:`~..core.plan.ModelPlan.effect`
            and its other settings, e.g. ``compile_blocks``), or None (an unsupported mode: no plan).

    The first cell of a group of equal plans is the reference and gets no flag; each later one
    gets ``option may not have taken effect (same per-block plan as <the others>)``. Measured
    numbers play no part.
    """
    groups: dict[Any, list[SweepCell]] = {}
    for cell, plan in zip(cells, plans):
        if plan is not None:
            groups.setdefault(plan, []).append(cell)
    for group in groups.values():
        for cell in group[1:]:
            others = ", ".join(c.mode for c in group if c is not cell)
            cell.flags = [f for f in cell.flags if not f.startswith(NO_EFFECT)]
            cell.flags.append(f"{NO_EFFECT} (same per-block plan as {others})")


def to_markdown(cells: list[SweepCell], family: str, measured_at: str = "") -> str:
    """The sweep as a markdown table in the documents' cell format, then each plan note once with
    the modes it holds for; ``measured_at``: what the cells trained on, added to the title
    (``5 frames (2 latent frames, 128 tokens per sample)``)."""
    title = f"# Checkpointing sweep: {family}" + (f", {measured_at}" if measured_at else "")
    lines = [title, "", "Cells: `sec/step / peak GiB`, or OOM / failed / "
             "unsupported / not run. Weights: `weight H2D GiB/step, stall %` of the streaming modes.", "",
             "| mode | backend | attention offload | result | weights | notes |", "|---|---|---|---|---|---|"]
    for c in cells:
        notes = "; ".join(c.flags + ([c.error.splitlines()[0][:160]] if c.error else []))
        weights = (f"{c.weight_h2d_bytes / 2**30:.4g}, {c.stall_share:.0%}"
                   if c.schedule.get("weight_offload") == "stream" and c.status == "ok" else "")
        lines.append(f"| {c.mode} | {c.schedule['gradient_checkpointing_backend']} | "
                     f"{'yes' if c.schedule['gradient_checkpointing_offload_attention'] else 'no'} | {c.text()} | "
                     f"{weights} | {notes} |")
    said: dict[str, list[str]] = {}  # each plan note once, with the modes it holds for
    for c in cells:
        for note in c.notes:
            said.setdefault(note, []).append(c.mode)
    if said:
        lines += ["", "Plan notes:"] + [f"- {note} ({', '.join(modes)})" for note, modes in said.items()]
    return "\n".join(lines) + "\n"


def to_csv(cells: list[SweepCell]) -> str:
    """The sweep as CSV: one row per cell (sec/step, peak bytes and GiB, status, error, flags)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["mode", "status", "sec_per_step", "peak_bytes", "peak_gib", "weight_h2d_bytes", "stall_share",
                     "cell", "error", "flags"])
    for c in cells:
        writer.writerow([c.mode, c.status, c.sec_per_step, c.peak_bytes,
                         None if c.peak_bytes is None else c.peak_bytes / 2**30, c.weight_h2d_bytes, c.stall_share,
                         c.text(), c.error, "; ".join(c.flags)])
    return out.getvalue()


def write_outputs(cells: list[SweepCell], folder: str | Path, family: str, budget_bytes: int | None = None,
                  measured_at: str = "", plot: bool = True) -> dict[str, Path]:
    """Write ``sweep.md``, ``sweep.csv``, ``sweep.json`` and (``plot``) ``sweep.png`` into ``folder``
    (atomically); ``measured_at``: see :func:`to_markdown` (also ``sweep.json`` ``measured_at`` when
    given). The plot takes about 0.2 s (matplotlib).

    Returns:
        The four paths by kind (``markdown``, ``csv``, ``json``, ``png``; the last written only with ``plot``).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "sweep.md", "csv": folder / "sweep.csv", "json": folder / "sweep.json",
             "png": folder / "sweep.png"}
    atomic_write_text(paths["markdown"], to_markdown(cells, family, measured_at))
    atomic_write_text(paths["csv"], to_csv(cells))
    atomic_write_text(paths["json"], json.dumps({"family": family, "budget_bytes": budget_bytes,
                                                 **({"measured_at": measured_at} if measured_at else {}),
                                                 "cells": [dataclasses.asdict(c) for c in cells]}, indent=2) + "\n")
    if plot:
        atomic_write_bytes(paths["png"], sweep_plot_png(cells, family, budget_bytes))
    return paths
