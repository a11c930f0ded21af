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
from .payloads import CATEGORY, DATASET, LORA_CONFIG, MODEL, SCHEDULE, FamilySchedule
from .widgets import NodeOptions, tip, widget

OPTIONS = NodeOptions({"batch_size": "batch_size"})


def _run_inputs() -> dict:
    return {
        "model": (MODEL, tip("From Load Diffusion Model.")),
        "dataset": (DATASET, tip("From Image+Caption Dataset (sets the image size).")),
        "batch_size": widget("batch_size"),
        "warmup_steps": ("INT", tip("Steps per mode excluded from the figures.", default=1, min=1, max=100)),
        "measured_steps": ("INT", tip("Steps per mode measured after the warm-up.", default=3, min=1, max=1000)),
        "run_name": ("STRING", tip("Name of the results: each queue writes output/segckpt/<run_name>_00001, "
                                   "_00002, ...", default="sweep")),
    }


def _config(model, dataset: api.DataConfig, batch_size, lora_config, output) -> api.TrainConfig:
    frames = {key: getattr(dataset, key) for key in api.FRAME_KEYS}  # clips measured at their frame buckets
    return api.TrainConfig.create(family=model.family.name, data=dataset.folder, resolution=dataset.resolution,
                                  buckets=dataset.buckets, batch_size=batch_size, lora=lora_config or api.LoraSettings(),
                                  output=str(output), base_model_precision=model.base_precision or "auto", **frames)


def _validate(run_name, inputs) -> bool:
    """The measurement nodes' VALIDATE_INPUTS: the run name stays under output/segckpt, the batch
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


class CheckpointingSweep:
    """Measures every checkpointing mode on the connected model: a plot (IMAGE) and the table."""

    CATEGORY, FUNCTION, OUTPUT_NODE = CATEGORY, "sweep", True
    RETURN_TYPES, RETURN_NAMES = ("IMAGE", "STRING"), ("plot", "table")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {**_run_inputs(),
                         "attention_offload_modes": ("BOOLEAN", tip("Also measure every mode with attention "
                                                                    "offload (doubles the sweep).", default=False)),
                         "budget_gib": ("FLOAT", tip("Memory budget drawn on the plot, GiB (0 = none).",
                                                     default=0.0, min=0.0, max=4096.0, step=0.0001))},
            "optional": {"lora_config": (LORA_CONFIG, tip("Optional: default rank 16, alpha 16."))},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, run_name=None, batch_size=None):
        return _validate(run_name, {"batch_size": batch_size})

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Every queue measures again (ComfyUI would otherwise reuse the cached result)."""
        return float("nan")

    @public_errors
    def sweep(self, model, dataset, batch_size, warmup_steps, measured_steps, run_name, attention_offload_modes,
              budget_gib, lora_config=None, unique_id=None):
        host = current_host()
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
        return {"ui": {"text": [table], "images": [{"filename": "sweep.png", "subfolder": subfolder, "type": "output"}]},
                "result": (image, table)}


class SchedulePlanner:
    """Picks the fastest schedule predicted to fit a memory budget; wires into Train LoRA."""

    CATEGORY, FUNCTION, OUTPUT_NODE = CATEGORY, "plan", True
    RETURN_TYPES, RETURN_NAMES = (SCHEDULE, "STRING"), ("schedule", "report")

    @classmethod
    def INPUT_TYPES(cls):
        inputs = _run_inputs()
        inputs["run_name"] = ("STRING", tip("Name of the planner's files: each queue writes output/segckpt/"
                                            "<run_name>_00001, _00002, ...", default="plan"))
        inputs["measured_steps"] = ("INT", tip("Steps to time the chosen prediction and up to 2 other fitting "
                                               "ones head to head (one step of each in turn) before deciding; "
                                               "0 = predict only.", default=2, min=0, max=1000))
        return {
            "required": {**inputs, "budget_gib": ("FLOAT", tip(
                "Memory budget in GiB; 0 = fit this device (its total memory).", default=0.0, min=0.0,
                max=4096.0, step=0.0001))},
            "optional": {"lora_config": (LORA_CONFIG, tip("Optional: default rank 16, alpha 16."))},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, run_name=None, batch_size=None):
        return _validate(run_name, {"batch_size": batch_size})

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Every queue measures again (ComfyUI would otherwise reuse the cached result)."""
        return float("nan")

    @public_errors
    def plan(self, model, dataset, batch_size, warmup_steps, measured_steps, run_name, budget_gib, lora_config=None,
             unique_id=None):
        host = current_host()
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
        return {"ui": {"text": [text]}, "result": (FamilySchedule(model.family.name, chosen), text)}
