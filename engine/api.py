"""The engine's facade: what the command line (``cli.py``) and the ComfyUI nodes (``nodes/``) call.

Entry points: :func:`train` (a run with its fit guardrails and receipt), :func:`check_fit` (the
pre-flight verdict), :func:`plan` (the fastest schedule predicted to fit a budget),
:func:`sweep` (every mode measured), :func:`load_model` and :func:`families` (the support
matrix). The names the front ends need besides (configs and their errors, the files the
measurements write, ComfyUI's data, the block strip's plan) are re-exported here, so a front end
imports this module and, at most, one more (``docs/ARCHITECTURE.md``). Importing it costs the
configs and the family adapters only: the implementations (torch, diffusers, peft) are imported
when a function needs them or a re-exported name is first read (:data:`_ON_FIRST_USE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .config import (
    ALIASES,
    OPTIONS,
    CheckpointSchedule,
    ConfigError,
    DataConfig,
    GuardrailsConfig,
    LoraSettings,
    ModelConfig,
    ObjectiveConfig,
    ScheduleError,
    TrainConfig,
    option_named,
    read_config_file,
)
from .config.backends import BACKENDS
from .config.data import FRAME_KEYS
from .config.options import Option
from .config.schedule import check_supported
from .config.table import options_page, options_table
from .core.support import support_table
from .families import FamilyAdapter, family_names, get_family
from .families.lazy import import_module, lazy_imports

if TYPE_CHECKING:
    from .measure.planner import PlanChoice
    from .measure.preflight import Verdict
    from .measure.sweep import SweepCell
    from .model.bundle import ModelBundle
    from .train.loop import TrainResult

_ON_FIRST_USE = {
    ".core.plan": ("ModelPlan", "unused_keys"),
    ".core.plan_query": ("PlanQueryError", "plan_for_query"),
    ".data.checks": ("check_dataset",),
    ".data.comfy_data": ("PreparedData", "prepare_comfy_data"),
    ".data.precheck": ("precheck", "cuda_absent", "check_optimizer"),
    ".data.comfy_frames": ("batch_encoder", "prepare_image_batch", "image_batch_multiple"),
    ".data.folder": ("write_sample_dataset",),
    ".data.video": ("write_sample_clip",),
    ".data.limits": ("check_frames", "check_resolution"),
    ".files.atomic": ("OutputWriteError", "atomic_write_bytes", "atomic_write_text", "check_writable"),
    ".files.checks": ("same_safetensors",),
    ".files.lock": ("FolderInUseError",),
    ".measure.frames": ("check_measure_frames", "frames_label"),
    ".measure.host": ("HostBudgetError", "usable_cores"),
    ".measure.planner": ("PlanChoice", "PlannerError"),
    ".measure.plots": ("loss_curve_rgb", "loss_graph_png"),
    ".measure.recipes": ("recipes_markdown",),
    ".measure.preflight": ("PreflightRefused", "Verdict"),
    ".measure.receipt": ("render_receipt",),
    ".measure.runs": ("MeasurementInterrupted", "PlanInterrupted"),
    ".measure.sweep": ("SweepCell", "sweep_schedules"),
    ".model.bundle": ("ModelBundle",),
    ".model.distributed": ("close_distributed",),
    ".model.lora_files": ("save_lora", "save_lora_files"),
    ".train.checks": ("check_input_paths", "check_run"),
    ".train.loop": ("TrainResult",),
    ".train.previews": ("PreviewSource", "comfy_preview_source"),
}
"""The names re-exported from the implementations, by module: imported on first use (PEP 562
``__getattr__`` below), so that importing the facade costs the configs and the family adapters
only, no torch, diffusers or peft (``segckpt --help``, a refused option, the ComfyUI pack's import;
``tests/test_startup.py``). The facade's own functions import what they call when called."""
_MODULE_OF = {name: module for module, names in _ON_FIRST_USE.items() for name in names}


def __getattr__(name: str) -> Any:
    """``api.<name>`` for a name of :data:`_ON_FIRST_USE`: its module is imported now, once.

    Raises:
        AttributeError: the facade has no such name.
    """
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_MODULE_OF[name], __package__), name)
    globals()[name] = value  # the next read is an ordinary one
    return value


def __dir__() -> list[str]:
    """The facade's names, those imported on first use included."""
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "FRAME_KEYS",
    "HostBudgetError", "host_budget", "usable_cores", "precheck", "cuda_absent", "OutputWriteError", "check_writable", "FolderInUseError",
    "check_optimizer",
    "ALIASES", "BACKENDS", "OPTIONS", "CheckpointSchedule", "ConfigError", "DataConfig", "FamilyAdapter",
    "GuardrailsConfig", "LoraSettings", "ObjectiveConfig", "MeasurementInterrupted", "PlanInterrupted", "ModelBundle", "ModelConfig", "ModelPlan",
    "PlanChoice", "PlanQueryError", "PlannerError", "PreflightRefused", "PreparedData", "PreviewSource",
    "ScheduleError", "SweepCell", "TrainConfig", "TrainResult", "Verdict", "atomic_write_bytes", "atomic_write_text",
    "Option", "budget", "lazy_imports", "check_dataset", "check_fit", "check_input_paths", "check_frames", "check_measure_frames", "check_resolution", "check_run", "options_page", "options_table", "write_schedule", "check_supported", "close_distributed", "comfy_preview_source", "families",
    "family_names", "frames_label", "get_family", "load_model", "loss_curve_rgb", "loss_graph_png", "model_family", "recipes_markdown", "option_named", "plan",
    "plan_for_query", "prepare_comfy_data", "prepare_image_batch", "batch_encoder", "image_batch_multiple", "read_config_file", "render_receipt", "same_safetensors", "save_lora",
    "save_lora_files", "sweep", "sweep_schedules", "train", "unused_keys", "write_fit", "write_plan",
    "write_sample_dataset", "write_sample_clip", "write_sweep",
]


def families(limits: bool = False) -> str:
    """The support matrix (Markdown, generated from the family adapters); with ``limits`` also
    each model's limits (read from the diffusers classes' default configs, so it imports them),
    as ``docs/FAMILIES.md``."""
    return support_table(limits)


def load_model(config: TrainConfig, log: Callable[[str], None] = print) -> ModelBundle:
    """The model ``config.model`` names, loaded offline (a folder, one file or a preset seeded by
    ``config.seed``).

    Raises:
        ModelLoadError: the folder or file cannot be used.
    """
    with lazy_imports():
        from .model.loading import load_bundle

    return load_bundle(config.model, config.seed, log=log)


def model_family(model_path: str | None, model_file: str | None) -> str | None:
    """The family of a model folder (its config's class) or of one ``.safetensors`` or ``.gguf``
    file (its keys); None when neither is given or exists.

    Raises:
        ModelLoadError: the folder or file is of no known family.
    """
    if model_path and Path(model_path).is_dir():
        with lazy_imports():
            from .model.folders import detect_family

        return detect_family(model_path)
    if model_file and model_file.endswith((".safetensors", ".gguf")) and Path(model_file).is_file():
        with lazy_imports():
            from .model.single_file import identify_file

        return identify_file(model_file).family.name
    return None


def budget(value: str | float | int, config: TrainConfig, key: str = "budget") -> int:
    """A memory budget in bytes on ``config``'s device: a number of GiB, ``device`` or ``free``.

    Raises:
        ConfigError: not a budget; the message names ``key``.
    """
    with lazy_imports():
        from .core.memory import budget_bytes
        from .model.loading import resolve_device

    return budget_bytes(value, resolve_device(config.model), key)


def host_budget(value: str | float | None, config: TrainConfig) -> int:
    """The host budget in bytes (``--host-budget``: GiB, ``free``, ``device``; default the host's
    available memory less a margin), refused before any model is built when ``config`` streams
    more frozen weights than it holds (``engine/measure/host.py``).

    Raises:
        HostBudgetError: an invalid value, or one below the streamed bytes (named).
    """
    with lazy_imports():
        from .measure.host import check_host_budget, host_budget_bytes

    budget_bytes_ = host_budget_bytes(value)
    check_host_budget(config, budget_bytes_, value)
    return budget_bytes_


def _recovery_guided_by(verdict: Verdict) -> Callable[[CheckpointSchedule, Any], CheckpointSchedule | None]:
    """Out-of-memory recovery that skips rungs predicted not to fit: the first schedule of the
    ladder (``engine/train/recovery.py``) whose predicted peak fits every probed shape, else the
    ladder's next rung."""
    with lazy_imports():
        from .measure.planner import predict
        from .train.recovery import cheaper_schedules

    def choose(schedule: CheckpointSchedule, family) -> CheckpointSchedule | None:
        ladder = cheaper_schedules(schedule, family)
        for candidate in ladder:
            if all(predict(p, candidate).peak_bytes <= verdict.budget_bytes for p in verdict.probes.values()):
                return candidate
        return ladder[0] if ladder else None
    return choose


def train(config: TrainConfig, *, bundle: ModelBundle | None = None, log: Callable[[str], None] = print,
          on_verdict: Callable[[Verdict], None] | None = None,
          on_preflight: Callable[[int, int], None] | None = None, **run: Any) -> TrainResult:
    """Train a LoRA with the fit guardrails: the pre-flight (when ``memory_budget`` is set) before
    step 1, out-of-memory recovery guided by its probes, and the receipt after the run
    (``report.json`` ``preflight`` and ``receipt``).

    Args:
        config: the run. bundle: the loaded model (default: loaded here when the pre-flight needs
            it, else by the run). log: where lines go.
        on_verdict: called with the verdict before training starts (a node shows it).
        on_preflight: the pre-flight's progress, ``(probe steps done, probe steps in all)``:
            ``(0, 0)`` while it encodes the data, then ``(0, K)`` and one call per probe step
            (``engine/measure/preflight.py``).
        run: passed to the run (``on_step``, ``should_stop``, ``cache_dir``, ``prepared``,
            ``preview_source``; ``engine/train/loop.py``).

    Raises:
        PreflightRefused: a phase is predicted not to fit and ``start_anyway`` is off (nothing
            is trained or written).
        HostBudgetError: the streamed weights' host copies would exceed the host's available
            memory less a margin (``engine/measure/host.py``), before any model is built.
        See ``engine/train/loop.py`` (``TrainingRun``) for the rest.
    """
    with lazy_imports():
        from .measure.host import check_host_budget, host_budget_bytes
        from .measure.preflight import PreflightRefused, preflight
        from .measure.receipt import build_receipt, render_receipt
        from .train.checks import check_input_paths
        from .train.loop import train as _train
        from .train.report import write_report

    verdict, guards = None, config.guards
    check_input_paths(config)  # the data's captions and images too: before the pre-flight loads the model
    if config.schedule.streams:  # the host must hold the streamed weights: refused before any model is built
        check_host_budget(config, host_budget_bytes())
    if guards.memory_budget is not None:
        bundle = bundle or load_model(config, log)
        verdict = preflight(config, bundle, budget(guards.memory_budget, config, "memory_budget"),
                            prepared=run.get("prepared"), should_stop=run.get("should_stop"), on_step=on_preflight)
        log(verdict.render())
        if on_verdict is not None:
            on_verdict(verdict)
        if not verdict.fits and not guards.start_anyway:
            fix = (f"set the schedule it names ({verdict.suggestion.mode})" if verdict.suggestion
                   else "lower the resolution or batch size")
            raise PreflightRefused(f"{verdict.render()}\nnot started: {fix}, raise --budget, or start anyway "
                                   "(--start-anyway)")
        run["next_schedule"] = _recovery_guided_by(verdict)
    result = _train(config, bundle=bundle, log=log, **run)
    if not result.writer:  # a rank other than 0 of a sharded run: rank 0 writes and prints
        return result
    receipt = build_receipt(result, verdict)
    result.report["receipt"] = receipt
    if verdict is not None:
        result.report["preflight"] = verdict.to_dict()
    write_report(result.report, Path(result.config.outputs.output))
    log(render_receipt(receipt))
    return result


def check_fit(config: TrainConfig, bundle: ModelBundle, budget_bytes: int, **probing: Any) -> Verdict:
    """The pre-flight verdict of ``config``'s schedule against ``budget_bytes`` in every phase
    (each batch shape, the previews) and of its host memory; ``probing``: ``warmup_steps``,
    ``prepared``, ``on_step``, ``should_stop``, ``host_budget_bytes`` (``engine/measure/preflight.py``).

    Raises:
        MeasurementInterrupted: ``should_stop`` answered True.
    """
    with lazy_imports():
        from .measure.preflight import preflight

    return preflight(config, bundle, budget_bytes, **probing)


def write_fit(verdict: Verdict, folder: str | Path) -> dict[str, Path]:
    """Write ``preflight.json`` and, when a schedule would fit, ``schedule.json`` (usable as
    ``segckpt train --config``) into ``folder``, atomically; their paths."""
    with lazy_imports():
        from .files.atomic import atomic_write_text

    folder = Path(folder)
    paths = {"preflight": atomic_write_text(folder / "preflight.json", json.dumps(verdict.to_dict(), indent=2) + "\n")}
    if verdict.suggestion is not None:
        paths["schedule"] = write_schedule(verdict.suggestion, folder)
    return paths


def write_schedule(schedule: CheckpointSchedule, folder: str | Path) -> Path:
    """Write ``schedule.json`` (the six keys) into ``folder``, atomically; its path."""
    with lazy_imports():
        from .files.atomic import atomic_write_text

    return atomic_write_text(Path(folder) / "schedule.json", json.dumps(schedule.to_dict(), indent=2) + "\n")


def plan(config: TrainConfig, bundle: ModelBundle, budget_bytes: int, measure_steps: int = 0, nproc: int = 1,
         **measuring: Any) -> PlanChoice:
    """The fastest schedule predicted to fit ``budget_bytes`` (timed head to head over
    ``measure_steps`` when > 0); ``measuring``: ``warmup_steps``, ``on_step``, ``should_stop``,
    ``host_budget_bytes`` (``engine/measure/planner.py``). ``nproc`` >= 2: the choice's per-rank
    peak under DDP and FSDP2 and which to run, in ``choice.ranks`` (``engine/measure/ranks.py``); when
    nothing fits one process, the fastest schedule whose FSDP2 per-rank peak fits (predicted).

    Raises:
        PlannerError: nothing fits (on one process, nor under FSDP2 on ``nproc``).
        MeasurementInterrupted: ``should_stop`` answered True.
        ValueError: ``nproc`` is not an integer >= 1 (before any probe runs).
    """
    with lazy_imports():
        from .measure.planner import PlannerError, plan_for_budget
        from .measure.ranks import check_nproc, rank_peaks, sharded_choice

    check_nproc(nproc)
    try:
        choice = plan_for_budget(config, bundle, budget_bytes, measure_steps=measure_steps, **measuring)
    except PlannerError as exc:
        if nproc == 1 or exc.probe is None:
            raise
        return sharded_choice(exc, budget_bytes, nproc)
    choice.ranks = rank_peaks(choice.probe, choice.chosen, budget_bytes, nproc)
    return choice


def write_plan(choice: PlanChoice, folder: str | Path) -> dict[str, Path]:
    """Write ``plan.txt`` and ``schedule.json`` (and with ``choice.ranks`` ``nproc.json``) into
    ``folder``, atomically; their paths."""
    with lazy_imports():
        from .measure.planner import write_choice

    return write_choice(choice, folder)


def sweep(config: TrainConfig, bundle: ModelBundle, schedules: list[CheckpointSchedule] | None = None,
          warmup_steps: int = 1, measured_steps: int = 3, **measuring: Any) -> list[SweepCell]:
    """Every schedule (default :func:`sweep_schedules`) trained on a fresh copy of ``bundle`` for
    ``warmup_steps + measured_steps`` steps; ``measuring``: ``log``, ``on_step``, ``should_stop``,
    ``on_cell``, ``frames`` (``engine/measure/sweep.py``)."""
    with lazy_imports():
        from .measure.sweep import run_sweep

    return run_sweep(config, bundle, schedules, warmup_steps, measured_steps, **measuring)


def write_sweep(cells: list[SweepCell], folder: str | Path, family: str,
                budget_bytes: int | None = None, measured_at: str = "") -> dict[str, Path]:
    """Write ``sweep.md``, ``sweep.csv``, ``sweep.json`` and ``sweep.png`` into ``folder``; their
    paths (``measured_at``: what the cells trained on, e.g. a frame count, in the title)."""
    with lazy_imports():
        from .measure.sweep import write_outputs

    return write_outputs(cells, folder, family, budget_bytes, measured_at)
