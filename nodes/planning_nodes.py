"""Nodes that measure and choose schedules: Checkpointing Sweep and Schedule Planner.

Thin adapters over ``engine/sweep.py`` and ``engine/planner.py``: they build the run settings
from their inputs, call the engine on a copy of the model, and wrap the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import torch
from PIL import Image

from ..engine.core.plan import check_supported
from ..engine.core.schedule import ScheduleError
from ..engine.measure.planner import parse_budget, plan_for_budget, write_choice
from ..engine.measure.preflight import preflight
from ..engine.measure.sweep import run_sweep, sweep_schedules, write_outputs
from ..engine.train.atomic import atomic_write_text
from ..engine.train.config import HELP, TrainConfig
from ..engine.train.loop import resolve_device
from ..engine.train.lora_io import LoraSettings
from ..engine.train.runs import MeasurementInterrupted
from .environment import PathError, contained, current_host, numbered_run, public_errors
from .training_nodes import CATEGORY, DATASET, LORA_CONFIG, MODEL, SCHEDULE, _tip


def _run_inputs() -> dict:
    return {
        "model": (MODEL, _tip("From Load Diffusion Model.")),
        "dataset": (DATASET, _tip("From Image+Caption Dataset (sets the image size).")),
        "batch_size": ("INT", _tip(HELP["batch_size"], default=1, min=1, max=1024)),
        "warmup_steps": ("INT", _tip("Steps per mode excluded from the figures.", default=1, min=1, max=100)),
        "measured_steps": ("INT", _tip("Steps per mode measured after the warm-up.", default=3, min=1, max=1000)),
        "run_name": ("STRING", _tip("Name of the results: each queue writes output/segckpt/<run_name>_00001, "
                                     "_00002, ...", default="sweep")),
    }


def _supported(family, schedule) -> bool:
    try:
        check_supported(family, schedule)
    except ScheduleError:
        return False
    return True


def _config(model, dataset, batch_size, lora_config, output) -> TrainConfig:
    return TrainConfig(family=model.family.name, data=dataset["data"], resolution=dataset["resolution"],
                       buckets=dataset.get("buckets", False), batch_size=batch_size,
                       lora=lora_config or LoraSettings(), output=str(output),
                       base_model_precision=model.base_precision or "auto")


def _validate_run_name(run_name):
    try:
        contained(current_host().output_dir / "segckpt", run_name, "run_name")
    except PathError as exc:
        return current_host().public(str(exc))
    return True


@contextlib.contextmanager
def _measuring(host, unique_id, total_steps: int):
    """Progress after every measured step, and Cancel within one step: ``(on_step, should_stop)``.

    Cancel ends the prompt as interrupted (the host's own exception), not as a failed node."""
    update, done = host.progress(unique_id, total_steps), [0]

    def on_step() -> None:
        done[0] += 1
        update(min(done[0], total_steps))

    try:
        yield on_step, host.interrupted
    except MeasurementInterrupted:
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
                         "attention_offload_modes": ("BOOLEAN", _tip("Also measure every mode with attention "
                                                                     "offload (doubles the sweep).", default=False)),
                         "budget_gib": ("FLOAT", _tip("Memory budget drawn on the plot, GiB (0 = none).",
                                                      default=0.0, min=0.0, max=4096.0, step=0.0001))},
            "optional": {"lora_config": (LORA_CONFIG, _tip("Optional: default rank 16, alpha 16."))},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, run_name):
        return _validate_run_name(run_name)

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
        schedules = sweep_schedules(attention_offload_modes)
        supported = [s for s in schedules if _supported(model.family, s)]
        with _measuring(host, unique_id, len(supported) * (warmup_steps + measured_steps)) as (on_step, stop):
            cells = run_sweep(config, model, schedules, warmup_steps, measured_steps, on_step=on_step,
                              should_stop=stop)
        budget = int(budget_gib * 2**30) if budget_gib > 0 else None
        paths = write_outputs(cells, folder, model.family.name, budget)
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
        inputs["run_name"] = ("STRING", _tip("Name of the planner's files: each queue writes output/segckpt/"
                                             "<run_name>_00001, _00002, ...", default="plan"))
        inputs["measured_steps"] = ("INT", _tip("Steps to time the chosen prediction and up to 2 other fitting "
                                                "ones head to head (one step of each in turn) before deciding; "
                                                "0 = predict only.", default=2, min=0, max=1000))
        return {
            "required": {**inputs, "budget_gib": ("FLOAT", _tip(
                "Memory budget in GiB; 0 = fit this device (its total memory).", default=0.0, min=0.0,
                max=4096.0, step=0.0001))},
            "optional": {"lora_config": (LORA_CONFIG, _tip("Optional: default rank 16, alpha 16."))},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, run_name):
        return _validate_run_name(run_name)

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
        budget = parse_budget("device" if budget_gib == 0 else budget_gib, resolve_device(config), key="budget_gib")
        # the probe (warm-up + 2), the offload calibration (2 runs of warm-up + 3) and up to 3
        # contenders timed head to head (warm-up + measured each)
        total = (warmup_steps + 2) + 2 * (warmup_steps + 3) + (3 * (warmup_steps + measured_steps) if measured_steps else 0)
        with _measuring(host, unique_id, total) as (on_step, stop):
            choice = plan_for_budget(config, model, budget, measure_steps=measured_steps, warmup_steps=warmup_steps,
                                     on_step=on_step, should_stop=stop)
            verdict = None
            if config.buckets:  # the probe mixed the buckets: judge the choice per bucket (pre-flight)
                verdict = preflight(dataclasses.replace(config, schedule=choice.chosen.schedule), model, budget,
                                    warmup_steps=warmup_steps, on_step=on_step, should_stop=stop)
        write_choice(choice, folder)
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
            atomic_write_text(folder / "schedule.json", json.dumps(chosen.to_dict(), indent=2) + "\n")
        return {"ui": {"text": [summary + "\n\n" + report]},
                "result": ({"family": model.family.name, "schedule": chosen}, summary + "\n\n" + report)}
