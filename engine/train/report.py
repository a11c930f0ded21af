"""``report.json``: the config, the effective plan per block list, per-step records and totals."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from ..core.memory import StepTimer
from ..core.plan import ModelPlan
from ..files.atomic import atomic_write_text
from ..model.precision import tensor_bytes

REPORT_FILE = "report.json"


def build_report(config, plan: ModelPlan, history: list[dict[str, Any]], timer: StepTimer,
                 device: torch.device, source: str, interrupted: bool,
                 setup: dict[str, Any] | None = None, start_step: int = 0) -> dict[str, Any]:
    """The run report as a JSON-ready dict.

    ``totals.steps`` counts every step of the run's history (a resumed run's earlier steps too);
    ``totals.trained_steps`` the steps this process trained after resuming at
    ``totals.resumed_at_step`` (``start_step``: 0 for a fresh run; a resume with nothing left
    trains 0).

    ``setup`` (from the trainer): ``precision`` (base, storage and compute dtypes, Linear layers
    and how many are quantized), ``attention_backend`` (SDPA kernels), ``memory`` (bytes of the
    frozen weights, of the LoRA and of the optimizer state; the activation peak is added here)
    ``stopped`` (the non-finite guard's message, or None), ``dataset`` (the image folder's counts,
    or for prepared data its source, count, shapes and latent format; ``batch_over_data`` when the
    batch is larger than an epoch's images: how many times each image repeats per step) and ``text_encoder`` (what
    encoded the captions: ``stand-in`` with its warning, ``transformers`` with the folders, or
    ``comfyui conditioning``), ``schedule_switches`` (out-of-memory recoveries: step, schedule
    before and after, the error), ``watchdog`` (slowdown and memory-growth reports) and ``resume``
    (None, or a resume that went on although the data changed, ``on_data_change=new_epoch``: what
    changed, the step it resumed from and the fresh epoch it continued with) and ``lora_files``
    (``{format: path}`` of the LoRA files written, ``lora_format``).

    ``ignored_config_keys`` names the config file's keys that mean nothing here
    (:meth:`~..config.TrainConfig.from_json_file`). ``totals.sec_per_step`` is the median over steps after ``timing_warmup_steps`` (None when no
    step is past the warm-up); ``totals.peak_bytes`` is the largest per-step peak. On CUDA a peak
    is ``torch.cuda.max_memory_allocated`` (weights included); on the CPU it is the live-tensor
    tracker's peak of tensors created during the step (weights and the cached data excluded).
    ``totals.tokens_per_sample`` is the largest step's latent token count per sample (latent frames
    x spatial patches per frame; each step's is its record's ``tokens``). ``totals.clipped_steps``
    counts the steps whose gradients ``max_grad_norm`` scaled down (each step's ``grad_norm`` is
    the norm before), ``totals.dropped_captions`` the samples that trained with the empty caption
    (``caption_dropout``; each step's ``dropped_captions``). ``optimizer`` (from the trainer): the
    ``optimizer`` option and the class that implemented it.
    """
    measured = [h["seconds"] for h in history[config.timing_warmup_steps:]]
    setup = dict(setup or {})
    # the run's peak: every step's, and the preview phase's (it counts, and is also given apart)
    peak = max([h["peak_bytes"] for h in history] + [setup.get("memory", {}).get("validation_peak_bytes", 0)])
    # the step's own memory above what it started with; step 1 also creates the optimizer state
    later = history[1:] or history
    memory = {**setup.pop("memory", {}), "activation_peak_bytes": max(
        (h["peak_bytes"] - h.get("start_bytes", 0) for h in later), default=0)}
    return {
        "config": config.to_dict(),
        "ignored_config_keys": list(config.ignored_keys),  # the config file's keys with no meaning here
        "simpletuner_defaults": list(config.simpletuner_defaults),  # SimpleTuner defaults taken for keys left out
        "model": {"family": plan.family, "source": source},
        "plan": plan.to_dict(),
        "steps": history,
        "totals": {
            "steps": len(history),
            "trained_steps": len(history) - start_step,
            "resumed_at_step": start_step,
            "interrupted": interrupted,
            "sec_per_step": statistics.median(measured) if measured else None,
            "timing_warmup_steps": config.timing_warmup_steps,
            "peak_bytes": peak,
            "peak_mib": round(peak / 2**20, 3),
            "peak_gib": round(peak / 2**30, 6),
            "peak_scope": "cuda max_memory_allocated" if device.type == "cuda"
            else "not measured (compile_blocks on the CPU: compiled code runs only untracked)"
            if config.model.compile_blocks else "cpu live tensors created during the step",
            "final_loss": history[-1]["loss"] if history else None,
            # latent tokens of one sample (latent frames x patches per frame), the largest batch's
            "tokens_per_sample": max((h.get("tokens", 0) for h in history), default=0),
            # max_grad_norm: the steps whose gradients were scaled down; caption_dropout: the samples
            "clipped_steps": sum(bool(h.get("clipped")) for h in history),
            "dropped_captions": sum(h.get("dropped_captions", 0) for h in history),
        },
        "memory": memory,
        **setup,
        "skipped_steps": [h["step"] for h in history if h.get("skipped")],
        "environment": {"device": str(device), "torch": torch.__version__,
                        "python": platform.python_version()},
    }


def memory_section(ctx, base, validation_peak: int) -> dict[str, int]:
    """``report.json``'s ``memory``: bytes of the frozen weights, the LoRA, the optimizer state and
    the preview phase's peak (the activation peak is added by :func:`build_report`).

    Args:
        ctx: the run's :class:`~.step.StepContext`. base: its :class:`~..model.precision.BaseWeights`.
    """
    return {"frozen_weight_bytes": base.frozen_bytes,
            "lora_bytes": sum(tensor_bytes(p) for _, p in ctx.named_params),
            "optimizer_state_bytes": sum(tensor_bytes(t) for slots in ctx.optimizer.state.values()
                                         for t in slots.values() if isinstance(t, torch.Tensor)),
            "validation_peak_bytes": validation_peak}


def write_report(report: dict[str, Any], output: str | Path) -> Path:
    """Write ``report.json`` into ``output`` atomically; return its path."""
    return atomic_write_text(Path(output) / REPORT_FILE, json.dumps(report, indent=2, default=str) + "\n")
