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
LORA_INPUT = "Optional: default rank 16, alpha 16."


def _run_inputs(**replaced: io.Input) -> list:
    """The inputs both measurement nodes take, in order; ``replaced``: a node's own input of that name."""
    inputs = {
        "model": Sockets.model.Input("model", tooltip="From Load Diffusion Model."),
        "dataset": Sockets.dataset.Input("dataset", tooltip="From Image+Caption Dataset (sets the image size)."),
        "batch_size": widget("batch_size"),
        "warmup_steps": io.Int.Input("warmup_steps", default=1, min=1, max=100,
                                     tooltip="Steps per mode excluded from the figures."),
        "measured_steps": io.Int.Input("measured_steps", default=3, min=1, max=1000,
                                       tooltip="Steps per mode measured after the warm-up."),
        "run_name": io.String.Input("run_name", default="sweep", tooltip="Name of the results: each queue writes "
                                    "output/segckpt/<run_name>_00001, _00002, ..."),
    }
    return list((inputs | replaced).values())


def _config(model, dataset: api.DataConfig, batch_size, lora_config, output) -> api.TrainConfig:
    frames = {key: getattr(dataset, key) for key in api.FRAME_KEYS}  # clips measured at their frame buckets
    return api.TrainConfig.create(family=model.family.name, data=dataset.folder, resolution=dataset.resolution,
                                  buckets=dataset.buckets, batch_size=batch_size, lora=lora_config or api.LoraSettings(),
                                  output=str(output), base_model_precision=model.base_precision or "auto", **frames)


def _validate(run_name, inputs) -> bool:
    """The measurement nodes' ``validate_inputs``: the run name stays under output/segckpt, the batch
    size is one the engine takes. Raised, so that ComfyUI lists the message once."""
    try:
        if run_name is not None:
            contained(current_host().output_dir / "segckpt", run_name, "run_name")
        OPTIONS.config(inputs)
    except (PathError, ValueError) as exc:
        raise node_error(exc) from None
    return True


class _Progress:
    """A node's progress bar over the engine's measurements, ``(done, total)`` per step (the
    engine's totals follow what it decided to run: the bar ends at its end); :meth:`next` starts
    another measurement after the ones before, on the same bar."""

    def __init__(self, update):
        self.update, self.base, self.done = update, 0, 0

    def __call__(self, done: int, total: int) -> None:
        self.done = done
        self.update(self.base + done, max(self.base + total, 1))

    def next(self) -> None:
        self.base, self.done = self.base + self.done, 0


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
                    io.Boolean.Input("attention_offload_modes", default=False,
                                     tooltip="Also measure every mode with attention offload (doubles the sweep)."),
                    io.Float.Input("budget_gib", default=0.0, min=0.0, max=4096.0, step=0.0001,
                                   tooltip="Memory budget drawn on the plot, GiB (0 = none)."),
                    Sockets.lora_config.Input("lora_config", optional=True, tooltip=LORA_INPUT)],
            outputs=[io.Image.Output(display_name="plot"), io.String.Output(display_name="table")],
            hidden=[io.Hidden.unique_id])

    @classmethod
    def validate_inputs(cls, run_name=None, batch_size=None):
        return _validate(run_name, {"batch_size": batch_size})

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
        schedules = api.sweep_schedules(attention_offload_modes)
        with _measuring(host, unique_id) as (on_step, stop):
            cells = api.sweep(config, model.load(), schedules, warmup_steps, measured_steps, on_step=on_step,
                              should_stop=stop)
        budget = int(budget_gib * 2**30) if budget_gib > 0 else None
        paths = api.write_sweep(cells, folder, model.family.name, budget)
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
               "measured_steps": io.Int.Input("measured_steps", default=2, min=0, max=1000, tooltip=(
                   "Steps to time the chosen prediction and up to 2 other fitting ones head to head (one step of "
                   "each in turn) before deciding; 0 = predict only."))}
        return io.Schema(
            node_id="SegCkptSchedulePlanner", display_name="Schedule Planner", category=CATEGORY, is_output_node=True,
            inputs=[*_run_inputs(**own),
                    io.Float.Input("budget_gib", default=0.0, min=0.0, max=4096.0, step=0.0001,
                                   tooltip="Memory budget in GiB; 0 = fit this device (its total memory)."),
                    Sockets.lora_config.Input("lora_config", optional=True, tooltip=LORA_INPUT)],
            outputs=[Sockets.schedule.Output(display_name="schedule"), io.String.Output(display_name="report")],
            hidden=[io.Hidden.unique_id])

    @classmethod
    def validate_inputs(cls, run_name=None, batch_size=None):
        return _validate(run_name, {"batch_size": batch_size})

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
        budget = api.budget("device" if budget_gib == 0 else budget_gib, config, key="budget_gib")
        bundle = model.load()  # this node's own copy, released when it returns
        with _measuring(host, unique_id) as (on_step, stop):
            choice = api.plan(config, bundle, budget, measure_steps=measured_steps, warmup_steps=warmup_steps,
                              on_step=on_step, should_stop=stop)
            verdict = None
            if config.data.buckets or config.data.video:  # the probe mixed shapes: judge per bucket (pre-flight)
                on_step.next()
                verdict = api.check_fit(config.replace(schedule=choice.chosen.schedule), bundle, budget,
                                        warmup_steps=warmup_steps, on_step=on_step, should_stop=stop)
        api.write_plan(choice, folder)
        report = choice.render()
        chosen = choice.chosen.schedule
        summary = (f"chosen: {chosen.mode} — predicted {choice.chosen.peak_bytes / 2**30:.3g} GiB"
                   + (f", measured {choice.measured_peak_bytes / 2**30:.3g} GiB" if choice.measured_peak_bytes else "")
                   + f" (budget {budget / 2**30:.3g} GiB)")
        if verdict is not None:
            if not verdict.fits and verdict.suggestion is not None:
                chosen = verdict.suggestion
                summary += f"\nper bucket it does not fit: chosen instead {chosen.mode}"
            summary += "\n" + verdict.render()
            api.write_schedule(chosen, folder)
        text = host.public(node_words(summary + "\n\n" + report))
        return io.NodeOutput(FamilySchedule(model.family.name, chosen), text, ui={"text": [text]})
