"""Nodes that measure and choose schedules: Checkpointing Sweep and Schedule Planner.

Thin adapters over the facade's ``sweep`` and ``plan``: they build the run settings from their
inputs, load the model for the node (released when it returns), call the engine and wrap the results.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from PIL import Image

from ..engine import api
from .environment import PathError, contained, current_host, node_error, numbered_run, public_errors
from .messages import node_words
from .payloads import CATEGORY, FamilySchedule, Sockets
from .v3 import io
from .widgets import NodeOptions, widget

OPTIONS = NodeOptions({"batch_size": "batch_size"})
SWEEP = NodeOptions({"warmup_steps": "warmup_steps", "measured_steps": "measured_steps",
                     "attention_offload_modes": "attention_offload", "budget_gib": "budget_gib"})
"""The Checkpointing Sweep's measurement widgets: node input -> option key (``engine/config/measure.py``)."""
PLAN = NodeOptions({"warmup_steps": "warmup_steps", "measured_steps": "timing_steps", "budget_gib": "budget"})
"""The Schedule Planner's (its ``budget_gib`` is the ``budget_gib`` widget read as ``budget``: 0 = this device)."""
LORA_INPUT = "Optional: default rank 16, alpha 16."


def _measured(key: str, name: str | None = None, **spec) -> io.Input:
    """The input of measurement option ``key`` (its default, range and tooltip declared once)."""
    return widget(key, name, options=api.MEASURE_OPTIONS, **spec)


def _run_inputs(**replaced: io.Input) -> list:
    """The inputs both measurement nodes take, in order; ``replaced``: a node's own input of that name."""
    inputs = {
        "model": Sockets.model.Input("model", tooltip="From Load Diffusion Model."),
        "dataset": Sockets.dataset.Input("dataset", tooltip="From Image+Caption Dataset (sets the image size)."),
        "batch_size": widget("batch_size"),
        "warmup_steps": _measured("warmup_steps"),
        "measured_steps": _measured("measured_steps"),
        "run_name": io.String.Input("run_name", default="sweep", tooltip="Name of the results: each queue writes "
                                    "output/segckpt/<run_name>_00001, _00002, ..."),
    }
    return list((inputs | replaced).values())


def _plan_values(inputs: dict) -> dict:
    """The planner's measurement values by option key: ``budget_gib`` 0 is this device's memory."""
    values = PLAN.values(inputs)
    if values.get("budget") == 0:
        values["budget"] = "device"
    return values


def _config(model, dataset: api.DataConfig, batch_size, lora_config, output) -> api.TrainConfig:
    frames = {key: getattr(dataset, key) for key in api.FRAME_KEYS}  # clips measured at their frame buckets
    return api.TrainConfig.create(family=model.family.name, data=dataset.folder, resolution=dataset.resolution,
                                  buckets=dataset.buckets, batch_size=batch_size, lora=lora_config or api.LoraSettings(),
                                  output=str(output), base_model_precision=model.base_precision or "auto", **frames)


def _validate(run_name, inputs, measured: dict) -> bool:
    """The measurement nodes' ``validate_inputs``: the run name stays under output/segckpt, the batch
    size and the ``measured`` values (by option key) are ones the engine takes. Raised, so that
    ComfyUI lists the message once."""
    try:
        if run_name is not None:
            contained(current_host().output_dir / "segckpt", run_name, "run_name")
        OPTIONS.config(inputs)
        api.MeasureConfig.create(**measured)
    except (PathError, ValueError) as exc:
        raise node_error(exc) from None
    return True


class _Progress:
    """A node's progress bar over the engine's measurements, ``(done, total)`` per step (the
    engine's totals follow what it decided to run: the bar ends at its end)."""

    def __init__(self, update):
        self.update = update

    def __call__(self, done: int, total: int) -> None:
        self.update(done, max(total, 1))


@contextlib.contextmanager
def _measuring(host, unique_id):
    """Progress after every measured step, and Cancel within one step: ``(progress, should_stop)``.

    Cancel ends the prompt as interrupted (the host's own exception), not as a failed node."""
    try:
        yield _Progress(host.progress(unique_id, 1)), host.interrupted
    except api.MeasurementInterrupted:
        host.raise_interrupt()
        raise


class CheckpointingSweep(io.ComfyNode):
    """Measures every checkpointing mode on the connected model: a plot (IMAGE) and the table."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SegCkptSweep", display_name="Checkpointing Sweep", category=CATEGORY, is_output_node=True,
            inputs=[*_run_inputs(),
                    # a node's sweep stays the short one by default (the CLI's sweep measures both)
                    _measured("attention_offload", "attention_offload_modes", default=False),
                    _measured("budget_gib"),
                    Sockets.lora_config.Input("lora_config", optional=True, tooltip=LORA_INPUT)],
            outputs=[io.Image.Output(display_name="plot"), io.String.Output(display_name="table")],
            hidden=[io.Hidden.unique_id])

    @classmethod
    def validate_inputs(cls, run_name=None, batch_size=None, **inputs):
        return _validate(run_name, {"batch_size": batch_size}, SWEEP.values(inputs))

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        """Every queue measures again (ComfyUI would otherwise reuse the cached result)."""
        return float("nan")

    @classmethod
    @public_errors
    def execute(cls, model, dataset, batch_size, warmup_steps, measured_steps, run_name, attention_offload_modes,
                budget_gib, lora_config=None):
        host, unique_id = current_host(), cls.hidden.unique_id
        folder = numbered_run(host.output_dir / "segckpt", run_name)
        config = _config(model, dataset, batch_size, lora_config, folder)
        measure = api.MeasureConfig.create(**SWEEP.values({
            "warmup_steps": warmup_steps, "measured_steps": measured_steps,
            "attention_offload_modes": attention_offload_modes, "budget_gib": budget_gib}))
        with _measuring(host, unique_id) as (on_step, stop):
            (table,) = api.sweep(config, measure, api.Progress(on_step, stop), bundle=model.load())
        paths = table.paths
        rgb = torch.from_numpy(np.asarray(Image.open(paths["png"]).convert("RGB")).copy())
        image = rgb.float().div(255.0).unsqueeze(0)
        table = paths["markdown"].read_text()
        subfolder = folder.resolve().relative_to(host.output_dir.resolve()).as_posix()
        return io.NodeOutput(image, table, ui={"text": [table], "images": [
            {"filename": "sweep.png", "subfolder": subfolder, "type": "output"}]})


class SchedulePlanner(io.ComfyNode):
    """Picks the fastest schedule predicted to fit a memory budget; wires into Train LoRA."""

    @classmethod
    def define_schema(cls):
        own = {"run_name": io.String.Input("run_name", default="plan", tooltip="Name of the planner's files: each "
                                           "queue writes output/segckpt/<run_name>_00001, _00002, ..."),
               "measured_steps": _measured("timing_steps", "measured_steps")}
        return io.Schema(
            node_id="SegCkptSchedulePlanner", display_name="Schedule Planner", category=CATEGORY, is_output_node=True,
            inputs=[*_run_inputs(**own),
                    _measured("budget_gib", tooltip="Memory budget in GiB; 0 = fit this device (its total memory)."),
                    Sockets.lora_config.Input("lora_config", optional=True, tooltip=LORA_INPUT)],
            outputs=[Sockets.schedule.Output(display_name="schedule"), io.String.Output(display_name="report")],
            hidden=[io.Hidden.unique_id])

    @classmethod
    def validate_inputs(cls, run_name=None, batch_size=None, **inputs):
        return _validate(run_name, {"batch_size": batch_size}, _plan_values(inputs))

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        """Every queue measures again (ComfyUI would otherwise reuse the cached result)."""
        return float("nan")

    @classmethod
    @public_errors
    def execute(cls, model, dataset, batch_size, warmup_steps, measured_steps, run_name, budget_gib, lora_config=None):
        host, unique_id = current_host(), cls.hidden.unique_id
        folder = numbered_run(host.output_dir / "segckpt", run_name)
        config = _config(model, dataset, batch_size, lora_config, folder)
        measure = api.MeasureConfig.create(**_plan_values({"warmup_steps": warmup_steps,
                                                           "measured_steps": measured_steps, "budget_gib": budget_gib}))
        with _measuring(host, unique_id) as (on_step, stop):  # the per-bucket check is the facade's, as the CLI's
            choice = api.plan(config, measure, api.Progress(on_step, stop), bundle=model.load())
        api.write_plan(choice, folder)
        report = choice.render()
        chosen = choice.chosen.schedule
        summary = (f"chosen: {chosen.mode} — predicted {choice.chosen.peak_bytes / 2**30:.3g} GiB"
                   + (f", measured {choice.measured_peak_bytes / 2**30:.3g} GiB" if choice.measured_peak_bytes else "")
                   + f" (budget {choice.budget_bytes / 2**30:.3g} GiB)")
        text = host.public(node_words(summary + "\n\n" + report))
        return io.NodeOutput(FamilySchedule(model.family.name, chosen), text, ui={"text": [text]})
