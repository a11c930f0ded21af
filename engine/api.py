"""The engine's facade: what the command line (``cli.py``) and the ComfyUI nodes (``nodes/``) call.

Entry points: :func:`train` (a run with its fit guardrails and receipt), and one verb per
measurement, each ``(config, measure_config, progress)`` with its checks once, before any model is
built: :func:`check_fit` (the pre-flight verdict), :func:`plan` (the fastest schedule predicted to
fit a budget), :func:`sweep` (every mode measured); and :func:`load_model` and :func:`families` (the support
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
    MEASURE_OPTIONS,
    OPTIONS,
    CheckpointSchedule,
    ConfigError,
    DataConfig,
    GuardrailsConfig,
    LoraSettings,
    MeasureConfig,
    ModelConfig,
    ObjectiveConfig,
    ScheduleError,
    TrainConfig,
    option_named,
    read_config_file,
)
from .config.backends import BACKENDS
from .config.data import FRAME_KEYS
from .config.measure import BUDGET_ALLOWED, OUTPUTS
from .config.options import Option
from .config.schedule import check_supported
from .config.table import options_page, options_table
from .core.support import support_table
from .families import FamilyAdapter, family_names, get_family
from .families.lazy import import_module, lazy_imports

if TYPE_CHECKING:
    from .measure.planner import PlanChoice
    from .measure.preflight import Verdict
    from .measure.runs import Progress
    from .measure.sweep import SweepTable
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
    ".data.limits": ("check_frames",),
    ".files.atomic": ("OutputWriteError", "atomic_write_bytes", "atomic_write_text"),
    ".files.checks": ("same_safetensors",),
    ".files.lock": ("FolderInUseError",),
    ".measure.host": ("HostBudgetError", "usable_cores"),
    ".measure.planner": ("PlanChoice", "PlannerError"),
    ".measure.plots": ("loss_curve_rgb", "loss_graph_png"),
    ".measure.recipes": ("recipes_markdown",),
    ".measure.preflight": ("PreflightRefused", "Verdict"),
    ".measure.receipt": ("render_receipt",),
    ".measure.runs": ("MeasurementInterrupted", "PlanInterrupted", "Progress"),
    ".measure.sweep": ("SweepCell", "SweepInterrupted", "SweepTable", "sweep_schedules"),
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
    "FRAME_KEYS", "MEASURE_OPTIONS", "OUTPUTS",
    "HostBudgetError", "host_budget", "usable_cores", "precheck", "cuda_absent", "OutputWriteError", "FolderInUseError",
    "check_optimizer",
    "ALIASES", "BACKENDS", "OPTIONS", "CheckpointSchedule", "ConfigError", "DataConfig", "FamilyAdapter",
    "GuardrailsConfig", "LoraSettings", "MeasureConfig", "ObjectiveConfig", "MeasurementInterrupted", "PlanInterrupted",
    "Progress", "ModelBundle", "ModelConfig", "ModelPlan",
    "PlanChoice", "PlanQueryError", "PlannerError", "PreflightRefused", "PreparedData", "PreviewSource",
    "ScheduleError", "SweepCell", "SweepInterrupted", "SweepTable", "TrainConfig", "TrainResult", "Verdict",
    "atomic_write_bytes", "atomic_write_text",
    "Option", "budget", "lazy_imports", "check_dataset", "check_fit", "check_input_paths", "check_frames", "check_run", "check_vae", "options_page", "options_table", "write_schedule", "check_supported", "close_distributed", "comfy_preview_source", "families",
    "family_names", "get_family", "load_model", "loss_curve_rgb", "loss_graph_png", "model_family", "recipes_markdown", "option_named", "plan",
    "plan_for_query", "prepare_comfy_data", "prepare_image_batch", "batch_encoder", "image_batch_multiple", "read_config_file", "render_receipt", "same_safetensors", "save_lora",
    "save_lora_files", "sweep", "sweep_schedules", "train", "unused_keys", "write_fit", "write_plan",
    "write_sample_dataset", "write_sample_clip",
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


def budget(value: str | float | int, model: ModelConfig, key: str = "budget") -> int:
    """A memory budget in bytes on ``model``'s device (``TrainConfig.model``): a number of GiB,
    ``device`` or ``free``.

    Raises:
        ConfigError: not a budget; the message names ``key``.
    """
    with lazy_imports():
        from .core.memory import budget_bytes
        from .model.loading import resolve_device

    return budget_bytes(value, resolve_device(model), key)


def host_budget(value: str | float | None, model: ModelConfig, schedule: CheckpointSchedule) -> int:
    """The host budget in bytes (``--host-budget``: GiB, ``free``, ``device``; default the host's
    available memory less a margin), refused before any model is built when ``schedule`` streams
    more of ``model``'s frozen weights than it holds (``engine/measure/host.py``).

    Raises:
        HostBudgetError: an invalid value, or one below the streamed bytes (named).
    """
    with lazy_imports():
        from .measure.host import check_host_budget, host_budget_bytes

    budget_bytes_ = host_budget_bytes(value)
    check_host_budget(model, schedule, budget_bytes_, value)
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
        on_preflight: the pre-flight's progress, ``(probe steps done, probe steps in all)``: ``(0, 0)``
            while it encodes the data, then ``(0, K)`` and one call per probe step (``engine/measure/preflight.py``).
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
        from .measure.runs import RunWorkspace
        from .train.checks import check_input_paths
        from .train.loop import train as _train
        from .train.report import write_report

    verdict, guards = None, config.guards
    check_input_paths(config)  # the data's captions and images too: before the pre-flight loads the model
    if config.schedule.streams:  # the host must hold the streamed weights: refused before any model is built
        check_host_budget(config.model, config.schedule, host_budget_bytes())
    if guards.memory_budget is not None:
        bundle = bundle or load_model(config, log)
        workspace = RunWorkspace(config, bundle, on_step=on_preflight, should_stop=run.get("should_stop"),
                                 prepared=run.get("prepared"))
        verdict = preflight(workspace, budget(guards.memory_budget, config.model, "memory_budget"))
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


def write_plan(choice: PlanChoice, folder: str | Path) -> dict[str, Path]:
    """Write ``plan.txt`` and ``schedule.json`` (and with ``choice.ranks`` ``nproc.json``) into
    ``folder``, atomically; their paths."""
    with lazy_imports():
        from .measure.planner import write_choice

    return write_choice(choice, folder)


def check_vae(model: ModelConfig) -> None:
    """A run or a measurement of the command line encodes its images (a node's model comes with
    its VAE): a single model file (``TrainConfig.model``) needs a VAE folder.

    Raises:
        ConfigError: ``model_file`` without ``vae_path``.
    """
    if model.model_file and not model.vae_path:
        raise ConfigError(f"vae_path=None is invalid with model_file={model.model_file!r}: allowed a "
                          "diffusers VAE folder (--vae-path); a single .safetensors file holds no VAE to "
                          "encode the images with")


def _measurement(config: TrainConfig, measure: MeasureConfig,
                 budgets: bool) -> tuple[MeasureConfig, int | None, int | None]:
    """The checks of every measurement, once, before any model is built: the frame counts against
    the family's rule (``engine/measure/frames.py``), the budgets (``budgets``: the plan's and the
    pre-flight's, in bytes; the host's counted against the streamed weights, ``engine/measure/host.py``),
    the data, the resolution against the model's position tables, a VAE for a single model file and
    a writable output folder.

    Returns:
        ``(measure, budget_bytes, host_budget_bytes)``: ``measure`` with its frame counts checked;
        the budgets (None without ``budgets``).

    Raises:
        ConfigError, HostBudgetError, ValueError: the first refusal, naming the key, the value and
            what is allowed.
    """
    with lazy_imports():
        from .data.limits import check_resolution
        from .files.atomic import check_writable
        from .measure.frames import check_measure_frames
        from .train.checks import check_input_paths

    if measure.frames:
        measure = measure.replace(frames=check_measure_frames(config.model, measure.frames, key="frames"))
    budget_bytes = host_bytes = None
    if budgets:
        if measure.plan.budget is None:
            raise ConfigError(f"budget=None is invalid: allowed {BUDGET_ALLOWED} (required)")
        budget_bytes = budget(measure.plan.budget, config.model, "budget")
        host_bytes = host_budget(measure.plan.host_budget, config.model, config.schedule)
    check_input_paths(config)
    check_resolution(config.model, config.data, config.validation.validation_frames)
    check_vae(config.model)
    check_writable(config.outputs.output, "output")
    return measure, budget_bytes, host_bytes


def sweep(config: TrainConfig, measure: MeasureConfig, progress: Progress | None = None, *,
          bundle: ModelBundle | None = None) -> list[SweepTable]:
    """Every mode ``measure`` names (``engine/config/measure.py``) trained on a fresh copy of the
    model for its warm-up and measured steps, on the run's data or once per frame count; the
    tables (``sweep.md``, ``.csv``, ``.json``, ``.png``) written into ``config``'s output folder
    (``frames-N/`` per count) after every mode (``engine/measure/sweep.py``).

    Args:
        progress: ``on_step``, ``should_stop`` and ``log`` (``engine/measure/runs.py``).
        bundle: the loaded model (default: loaded here, after the checks).

    Raises:
        ConfigError, ValueError: see :func:`_measurement` (before any model is built).
        SweepInterrupted: ``should_stop`` answered True, or Ctrl-C; the tables hold what was measured.
    """
    with lazy_imports():
        from .measure.runs import Progress, RunWorkspace
        from .measure.sweep import sweep_tables

    measure, progress = _measurement(config, measure, budgets=False)[0], progress or Progress()
    workspace = RunWorkspace(config, bundle or load_model(config, progress.log), on_step=progress.on_step,
                             should_stop=progress.should_stop)
    return sweep_tables(workspace, measure, progress)


def plan(config: TrainConfig, measure: MeasureConfig, progress: Progress | None = None, *,
         bundle: ModelBundle | None = None) -> PlanChoice:
    """The fastest schedule predicted to fit ``measure``'s budget (timed head to head over its
    timing steps when > 0, with its levers), judged per batch shape when the data has several, and
    with ``nproc`` >= 2 per rank under DDP and FSDP2 (``engine/measure/planning.py``); write it
    with :func:`write_plan`.

    Args:
        progress: ``on_step`` and ``should_stop`` (``engine/measure/runs.py``).
        bundle: the loaded model (default: loaded here, after the checks).

    Raises:
        ConfigError, HostBudgetError, ValueError: see :func:`_measurement` (before any model is built).
        PlannerError: nothing fits (on one process, nor under FSDP2 on ``nproc``).
        MeasurementInterrupted: ``should_stop`` answered True (``PlanInterrupted``, holding the
            prediction, during the head-to-head timing).
    """
    with lazy_imports():
        from .measure.planning import plan_for_budget
        from .measure.runs import Progress, RunWorkspace

    measure, budget_bytes, host_bytes = _measurement(config, measure, budgets=True)
    progress = progress or Progress()
    workspace = RunWorkspace(config, bundle or load_model(config, progress.log), on_step=progress.on_step,
                             should_stop=progress.should_stop)
    return plan_for_budget(workspace, measure, budget_bytes, host_budget_bytes=host_bytes)


def check_fit(config: TrainConfig, measure: MeasureConfig, progress: Progress | None = None, *,
              bundle: ModelBundle | None = None) -> Verdict:
    """The pre-flight verdict of ``config``'s schedule against ``measure``'s budget in every phase
    (each batch shape or frame count, the previews) and of its host memory
    (``engine/measure/preflight.py``); write it with :func:`write_fit`.

    Args:
        progress: ``on_step`` and ``should_stop`` (``engine/measure/runs.py``).
        bundle: the loaded model (default: loaded here, after the checks).

    Raises:
        ConfigError, HostBudgetError, ValueError: see :func:`_measurement` (before any model is built).
        MeasurementInterrupted: ``should_stop`` answered True.
    """
    with lazy_imports():
        from .measure.preflight import preflight
        from .measure.runs import Progress, RunWorkspace

    measure, budget_bytes, host_bytes = _measurement(config, measure, budgets=True)
    progress = progress or Progress()
    workspace = RunWorkspace(config, bundle or load_model(config, progress.log), on_step=progress.on_step,
                             should_stop=progress.should_stop)
    return preflight(workspace, budget_bytes, measure, host_budget_bytes=host_bytes)
