"""``report.json``: the config, the effective plan per block list, per-step records and totals; the
run's training recipe (:func:`recipe_section`, printed as one line at the start by :func:`recipe_line`)
and its loss by noise level (:func:`loss_by_noise_level`)."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import LoraSettings, ObjectiveConfig, OptimizerConfig
from ..files.atomic import atomic_write_text
from ..model.precision import tensor_bytes

if TYPE_CHECKING:  # its module imports diffusers
    from .objectives import NoiseSchedule

REPORT_FILE = "report.json"
NOISE_BINS = 10
"""Equal bins of the noise level on ``[0, 1]`` that :func:`loss_by_noise_level` counts the samples in."""


def build_report(ctx, history: list[dict[str, Any]], source: str, interrupted: bool,
                 setup: dict[str, Any] | None = None, start_step: int = 0) -> dict[str, Any]:
    """The run report of ``ctx``'s run (its :class:`~.step.StepContext`: config, plan, device) as a
    JSON-ready dict.

    ``totals.steps`` counts every step of the run's history (a resumed run's earlier steps too);
    ``totals.trained_steps`` the steps this process trained after resuming at
    ``totals.resumed_at_step`` (``start_step``: 0 for a fresh run; a resume with nothing left
    trains 0).

    ``setup`` (from the trainer): ``precision`` (base, storage and compute dtypes, Linear layers
    and how many are quantized), ``attention_backend`` (SDPA kernels), ``memory`` (bytes of the
    frozen weights, of the LoRA and of the optimizer state; the activation peak and the host arena,
    :func:`host_arena_section`, are added here)
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
    ``optimizer`` option and the class that implemented it. ``recipe`` (from the trainer):
    :func:`recipe_section`. ``loss_by_noise_level``: :func:`loss_by_noise_level` of the history.
    """
    config, plan = ctx.config, ctx.runner.plan
    setup = dict(setup or {})
    # the step's own memory above what it started with; step 1 also creates the optimizer state
    later = history[1:] or history
    memory = {**setup.pop("memory", {}), "activation_peak_bytes": max(
        (h["peak_bytes"] - h.get("start_bytes", 0) for h in later), default=0),
        "host_arena": host_arena_section(history[-1] if history else {})}
    return {
        "config": config.to_dict(),
        "ignored_config_keys": list(config.ignored_keys),  # the config file's keys with no meaning here
        "simpletuner_defaults": list(config.simpletuner_defaults),  # SimpleTuner defaults taken for keys left out
        "model": {"family": plan.family, "source": source},
        "plan": plan.to_dict(),
        "steps": history,
        "totals": _totals(history, config.timing_warmup_steps, ctx.device, config.model.compile_blocks,
                          memory.get("validation_peak_bytes", 0), interrupted, start_step),
        "loss_by_noise_level": loss_by_noise_level(history),
        "memory": memory,
        **setup,
        "skipped_steps": [h["step"] for h in history if h.get("skipped")],
        "environment": {"device": str(ctx.device), "torch": torch.__version__, "python": platform.python_version()},
    }


def _totals(history: list[dict[str, Any]], warmup_steps: int, device: torch.device, compiled: bool,
            validation_peak: int, interrupted: bool, start_step: int) -> dict[str, Any]:
    """``report.json``'s ``totals`` (:func:`build_report` says what each counts)."""
    measured = [h["seconds"] for h in history[warmup_steps:]]
    # the run's peak: every step's, and the preview phase's (it counts, and is also given apart)
    peak = max([h["peak_bytes"] for h in history] + [validation_peak])
    return {
        "steps": len(history),
        "trained_steps": len(history) - start_step,
        "resumed_at_step": start_step,
        "interrupted": interrupted,
        "sec_per_step": statistics.median(measured) if measured else None,
        "timing_warmup_steps": warmup_steps,
        "peak_bytes": peak,
        "peak_mib": round(peak / 2**20, 3),
        "peak_gib": round(peak / 2**30, 6),
        "peak_scope": "cuda max_memory_allocated" if device.type == "cuda"
        else "not measured (compile_blocks on the CPU: compiled code runs only untracked)"
        if compiled else "cpu live tensors created during the step",
        "final_loss": history[-1]["loss"] if history else None,
        # latent tokens of one sample (latent frames x patches per frame), the largest batch's
        "tokens_per_sample": max((h.get("tokens", 0) for h in history), default=0),
        # max_grad_norm: the steps whose gradients were scaled down; caption_dropout: the samples
        "clipped_steps": clipped_steps(history),
        "dropped_captions": dropped_captions(history),
    }


def memory_section(ctx, base, validation_peak: int, device_free: int | None = None) -> dict[str, Any]:
    """``report.json``'s ``memory``: bytes of the frozen weights, the LoRA, the optimizer state, the
    preview phase's peak and ``device_free_bytes_at_start`` (the CUDA driver's free device memory
    before the run loaded anything, ``torch.cuda.mem_get_info``; None on the CPU). The activation
    peak and the host arena are added by :func:`build_report`.

    Args:
        ctx: the run's :class:`~.step.StepContext`. base: its :class:`~..model.precision.BaseWeights`.
        validation_peak: the preview phase's peak, bytes. device_free: free device bytes at start.
    """
    return {"device_free_bytes_at_start": device_free, "frozen_weight_bytes": base.frozen_bytes,
            "lora_bytes": sum(tensor_bytes(p) for _, p in ctx.named_params),
            "optimizer_state_bytes": sum(tensor_bytes(t) for slots in ctx.optimizer.state.values()
                                         for t in slots.values() if isinstance(t, torch.Tensor)),
            "validation_peak_bytes": validation_peak}


def host_arena_section(record: dict[str, Any]) -> dict[str, Any]:
    """``report.json``'s ``memory.host_arena``: the host memory of streamed weights and offloaded
    activations at the last step (engine/core/arena.py): ``allocated_bytes`` (the chunks),
    ``used_bytes`` (the tensors in them), ``ratio`` (allocated / used; None when nothing is used),
    ``chunks``, ``pinned_bytes`` (of the allocated bytes, those pinned: 0 without CUDA).

    Args:
        record: a step record of ``report.json``'s ``steps`` (its ``host_arena_*`` fields).
    """
    allocated, used = record.get("host_arena_bytes", 0), record.get("host_arena_used_bytes", 0)
    return {"allocated_bytes": allocated, "used_bytes": used, "ratio": round(allocated / used, 4) if used else None,
            "chunks": record.get("host_arena_chunks", 0), "pinned_bytes": record.get("pinned_host_bytes", 0)}


def write_report(report: dict[str, Any], output: str | Path) -> Path:
    """Write ``report.json`` into ``output`` atomically; return its path."""
    return atomic_write_text(Path(output) / REPORT_FILE, json.dumps(report, indent=2, default=str) + "\n")


def clipped_steps(history: list[dict[str, Any]]) -> int:
    """The steps of ``history`` whose gradients ``max_grad_norm`` scaled down."""
    return sum(bool(h.get("clipped")) for h in history)


def dropped_captions(history: list[dict[str, Any]]) -> int:
    """The samples of ``history`` that trained with the empty caption (``caption_dropout``)."""
    return sum(h.get("dropped_captions", 0) for h in history)


def recipe_section(objective: ObjectiveConfig, opt: OptimizerConfig, lora: LoraSettings, caption_dropout: float,
                   noise: NoiseSchedule, history: list[dict[str, Any]] | None = None,
                   optimizer_class: str | None = None) -> dict[str, Any]:
    """``report.json``'s ``recipe``: what the run trains with, in one place (also :func:`recipe_line`).

    Args:
        objective, opt, lora, caption_dropout: the run's options of each (``config.objective``, ...).
        noise: its :class:`~.objectives.NoiseSchedule`, whose
            ``shifts`` hold the shift resolved per token count (one per bucket and frame count) so far.
        history: the steps so far (the clipped steps and dropped captions are counted); None: none yet.
        optimizer_class: the class that implements ``optimizer`` (None before it is built).

    Returns:
        ``sampling`` (``timestep_sampling`` and its parameters; epsilon families: uniform DDPM steps),
        ``flow_shift`` and ``scheduler`` (the config it resolves, its source), ``shifts`` (per token
        count: ``shift``, ``mu``, ``time_shift_type``, ``dynamic``), ``loss_weighting``
        (+ ``snr_gamma`` with ``min_snr``), ``guidance``, ``clipping``, ``caption_dropout``,
        ``optimizer`` and ``adapter`` (``targets``: a preset name or the module names).
    """
    summary = noise.summary()
    flow = summary["objective"] == "flow"
    sampling = {"name": summary["timestep_sampling"]}
    if flow and objective.timestep_sampling == "logit_normal":
        sampling.update(logit_mean=objective.logit_mean, logit_std=objective.logit_std)
    elif flow and objective.timestep_sampling == "mode":
        sampling["mode_scale"] = objective.mode_scale
    weighting = {"name": objective.loss_weighting}
    if objective.loss_weighting == "min_snr":
        weighting["snr_gamma"] = objective.snr_gamma
    targets = lora.target_modules
    history = history or []
    return {
        "objective": summary["objective"], "sampling": sampling, "flow_shift": summary["flow_shift"],
        "scheduler": summary["scheduler"],
        "shifts": [{"tokens": int(tokens), **{k: v for k, v in shift.items() if k != "tokens"}}
                   for tokens, shift in summary["shifts"].items()] if flow else [],
        "loss_weighting": weighting,
        "guidance": {"value": objective.guidance_value, "input": noise.family.guidance_input},
        "clipping": {"max_grad_norm": opt.max_grad_norm, "clipped_steps": clipped_steps(history)},
        "caption_dropout": {"probability": caption_dropout, "dropped_captions": dropped_captions(history)},
        "optimizer": {"name": opt.name, "class": optimizer_class, "learning_rate": opt.learning_rate,
                      "weight_decay": opt.weight_decay, "lr_scheduler": opt.lr_scheduler,
                      "lr_warmup_steps": opt.lr_warmup_steps},
        "adapter": {"lora_type": lora.lora_type, "use_dora": lora.use_dora, "rank": lora.rank, "alpha": lora.alpha,
                    "dropout": lora.dropout, "lokr_factor": lora.factor,
                    "lokr_full_matrix": lora.full_matrix,
                    "targets": "attention" if targets is None else targets[0] if targets == ("all-linear",)
                    else list(targets)},
    }


def recipe_line(recipe: dict[str, Any]) -> str:
    """:func:`recipe_section` as the one line a run prints at its start, e.g. ``recipe: logit_normal(0, 1),
    flow_shift auto (dynamic: ...): 1.63 at 256 tokens, loss none, guidance 1, clip 1, caption_dropout 0,
    adamw lr 0.001 wd 0, lora r16 a16 attention``."""
    sampling = recipe["sampling"]
    params = [v for k, v in sampling.items() if k != "name"]
    parts = [sampling["name"] + (f"({', '.join(f'{v:g}' for v in params)})" if params else "")]
    if recipe["objective"] == "flow":
        scheduler = f" ({recipe['scheduler']['config']})" if recipe["flow_shift"] == "auto" and recipe["scheduler"] else ""
        shifts = ", ".join(f"{s['shift']:.4g} at {s['tokens']} tokens" for s in recipe["shifts"])
        parts.append(f"flow_shift {recipe['flow_shift']}{scheduler}" + (f": {shifts}" if shifts else ""))
    weighting = recipe["loss_weighting"]
    parts.append(f"loss {weighting['name']}" + (f"(gamma {weighting['snr_gamma']:g})" if "snr_gamma" in weighting else ""))
    opt, adapter = recipe["optimizer"], recipe["adapter"]
    kind = adapter["lora_type"] + ("+dora" if adapter["use_dora"] else "")
    kind += f"(factor {adapter['lokr_factor']})" if adapter.get("lokr_factor", -1) != -1 else ""
    kind += "(full matrix)" if adapter.get("lokr_full_matrix") else ""
    targets = adapter["targets"] if isinstance(adapter["targets"], str) else ",".join(adapter["targets"])
    parts += [f"guidance {recipe['guidance']['value']:g}", f"clip {recipe['clipping']['max_grad_norm']:g}",
              f"caption_dropout {recipe['caption_dropout']['probability']:g}",
              f"{opt['name']} lr {opt['learning_rate']:g} wd {opt['weight_decay']:g}",
              f"{kind} r{adapter['rank']} a{adapter['alpha']:g} {targets}"]
    return "recipe: " + ", ".join(parts)


def loss_by_noise_level(history: list[dict[str, Any]], bins: int = NOISE_BINS) -> dict[str, Any]:
    """Each trained sample's loss binned by its noise level (rebuilt from the steps' records, so a
    resumed run's bins equal an uninterrupted one's).

    The loss is the sample's unweighted mean squared error (before ``loss_weighting``): what the model
    gets wrong at each noise level. The noise level is the flow sigma in ``[0, 1]``; for epsilon
    families the normalized DDPM step ``t / 1000``.

    Args:
        history: per-step records with ``noise_levels`` and ``sample_losses`` (one per sample, ``(B,)``
            lists; records without them, from earlier releases, count nothing).
        bins: equal bins on ``[0, 1]``: bin ``k`` holds ``[k / bins, (k + 1) / bins)``, the last one 1 too.

    Returns:
        ``{"measure", "samples", "bins": [{"low", "high", "count", "mean_loss"}]}`` (``mean_loss`` None
        for an empty bin).
    """
    sums, counts = [0.0] * bins, [0] * bins
    for record in history:
        for sigma, loss in zip(record.get("noise_levels", ()), record.get("sample_losses", ())):
            k = min(int(sigma * bins), bins - 1)
            sums[k] += loss
            counts[k] += 1
    return {"measure": "per-sample mean squared error before loss_weighting; noise level: sigma (flow), "
                       "t / 1000 (epsilon)",
            "samples": sum(counts),
            "bins": [{"low": k / bins, "high": (k + 1) / bins, "count": counts[k],
                      "mean_loss": sums[k] / counts[k] if counts[k] else None} for k in range(bins)]}
