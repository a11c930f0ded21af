"""The receipt of a run: what it measured per phase, and what each active memory option saved and
cost on this run against its cheaper or faster neighbour schedule.

Measured: sec/step (median after warm-up), the peak of each training phase (each batch shape,
with its latent tokens per sample: latent frames x patches per frame),
the preview phase's peak, the schedule switches, the host memory of streamed weights and offloaded
activations as allocated against used (``host_arena``, engine/core/arena.py) and the device memory free
at the start (CUDA). Compared (when the pre-flight probed the run's
shapes): for each option the final schedule has on, the neighbour schedule with only that option
off (checkpointing off; interval 1; no stride; the ``torch`` backend; attention offload off), with
both predicted by the planner's model from the probes' measurements (:func:`~.planner.predict`):
memory saved = the neighbour's predicted peak - the schedule's, time cost = the schedule's
predicted sec/step - the neighbour's (each weighted over the shapes' mix). An option that changes
the peak by less than :data:`NO_EFFECT` of it and does not make steps faster either is flagged:
it buys nothing on this model at these shapes (e.g. attention offload when every block is
checkpointed whole: nothing is left to offload). Phase peaks are those of the steps after the
timing warm-up, the scope the probes and the planner use.
"""

from __future__ import annotations

from typing import Any

from ..config.backends import DEFAULT
from ..config.schedule import CheckpointSchedule
from ..train.loop import TrainResult
from .planner import predict
from .preflight import Verdict

NO_EFFECT = 0.01
"""Savings below this fraction of the schedule's predicted peak count as no measurable effect."""


def neighbours(schedule: CheckpointSchedule) -> dict[str, CheckpointSchedule]:
    """Each option ``schedule`` has on -> the schedule with only that option off."""
    out: dict[str, CheckpointSchedule] = {}
    if schedule.gradient_checkpointing:
        out["gradient_checkpointing"] = schedule.replace(gradient_checkpointing=False)
        if schedule.interval > 1:
            stride = schedule.gradient_checkpointing_segment_stride
            out["gradient_checkpointing_interval"] = schedule.replace(
                gradient_checkpointing_interval=1 if stride else None)
        if schedule.stride != schedule.interval:
            out["gradient_checkpointing_segment_stride"] = schedule.replace(gradient_checkpointing_segment_stride=None)
        if schedule.backend != DEFAULT:
            out["gradient_checkpointing_backend"] = schedule.replace(gradient_checkpointing_backend=DEFAULT.name)
    if schedule.gradient_checkpointing_offload_attention:
        out["gradient_checkpointing_offload_attention"] = schedule.replace(
            gradient_checkpointing_offload_attention=False)
    return out


def _mixed(verdict: Verdict, schedule: CheckpointSchedule) -> tuple[int, float]:
    """(largest predicted peak over the shapes, sec/step weighted by the shapes' shares)."""
    shares = {p.shape: p.share for p in verdict.phases if p.kind == "train"}
    predictions = {key: predict(probe, schedule) for key, probe in verdict.probes.items()}
    return (max(p.peak_bytes for p in predictions.values()),
            sum(shares.get(key, 0.0) * p.sec_per_step for key, p in predictions.items()))


def option_effects(verdict: Verdict, schedule: CheckpointSchedule) -> list[dict[str, Any]]:
    """Per active option of ``schedule``: bytes saved and seconds per step spent against its
    neighbour, and whether the saving is measurable."""
    peak, seconds = _mixed(verdict, schedule)
    effects = []
    for option, neighbour in neighbours(schedule).items():
        other_peak, other_seconds = _mixed(verdict, neighbour)
        saved, cost = other_peak - peak, seconds - other_seconds
        fraction = cost / other_seconds if other_seconds else 0.0
        effects.append({"option": option, "value": getattr(schedule, option), "neighbour": neighbour.mode,
                        "saved_bytes": saved, "cost_seconds_per_step": cost, "cost_fraction": fraction,
                        # neither memory nor time bought: it saves no memory and does not speed up
                        "no_effect": abs(saved) < NO_EFFECT * max(peak, 1) and fraction > -NO_EFFECT})
    return effects


def build_receipt(result: TrainResult, verdict: Verdict | None) -> dict[str, Any]:
    """The receipt of a finished (or stopped) run; see the module docstring."""
    report, history = result.report, result.history
    peaks: dict[str, int] = {}
    tokens: dict[str, int] = {}
    # after the warm-up, as the probes and the planner measure (on the CPU, step 1's peak also
    # counts the optimizer state it creates, which later steps' tracker leaves out)
    for h in history[result.config.timing_warmup_steps:] or history:
        key = h.get("shape", "")
        peaks[key] = max(peaks.get(key, 0), h["peak_bytes"])
        tokens[key] = h.get("tokens", 0)
    receipt: dict[str, Any] = {
        "sec_per_step": report["totals"]["sec_per_step"],
        "peak_bytes_by_phase": {**{f"train {k}": v for k, v in sorted(peaks.items())},
                                "validation previews": report["memory"].get("validation_peak_bytes", 0)},
        # latent tokens per sample of each training phase: latent frames x patches per frame
        "tokens_by_phase": {f"train {k}": v for k, v in sorted(tokens.items()) if v},
        "schedule": result.plan.mode,
        "schedule_switches": [f"step {s['step']}: {s['from']} -> {s['to']}"
                              for s in report.get("schedule_switches", [])],
        "options": [],
    }
    compiled = report.get("compile")
    if compiled:  # compile_blocks: what compiled, its graphs and recompiles, its seconds
        receipt["compile"] = {k: compiled[k] for k in ("compiled_blocks", "graphs_after_first_step",
                                                       "recompiles_after_every_shape", "compile_seconds")}
    arena = report["memory"].get("host_arena") or {}
    if arena.get("allocated_bytes"):  # streamed weights, offloaded activations: host memory as allocated
        receipt["host_arena"] = arena
    if report["memory"].get("device_free_bytes_at_start") is not None:
        receipt["device_free_bytes_at_start"] = report["memory"]["device_free_bytes_at_start"]
    saved = sum(h.get("saved_attention_bytes", 0) for h in history[-1:])
    if saved:  # save_attention: the attention outputs kept per step
        receipt["saved_attention_bytes"] = saved
    if verdict is None:
        receipt["note"] = ("no probe of this run's shapes (no memory budget): give --budget for what each "
                           "memory option saved and cost")
    else:
        receipt["options"] = option_effects(verdict, result.config.schedule)
        receipt["predicted_peak_bytes"] = _mixed(verdict, result.config.schedule)[0]
    return receipt


def render_receipt(receipt: dict[str, Any]) -> str:
    """The receipt as lines (the CLI's last lines, the Run Report node)."""
    sec = receipt["sec_per_step"]
    lines = [f"receipt: {receipt['schedule']}, {sec:.3f} sec/step" if sec is not None
             else f"receipt: {receipt['schedule']}"]
    tokens = receipt.get("tokens_by_phase", {})
    lines += [f"  peak {phase}" + (f" ({tokens[phase]} tokens)" if tokens.get(phase) else "") + f": {_size(n)}"
              for phase, n in receipt["peak_bytes_by_phase"].items() if n]
    lines += [f"  switched at {s}" for s in receipt["schedule_switches"]]
    if receipt.get("device_free_bytes_at_start") is not None:
        lines.append(f"  device memory free at start: {_size(receipt['device_free_bytes_at_start'])}")
    if receipt.get("host_arena"):
        lines.append(_arena_line(receipt["host_arena"]))
    if receipt.get("saved_attention_bytes"):
        lines.append(f"  attention outputs kept per step (save_attention): {_size(receipt['saved_attention_bytes'])}")
    if receipt.get("compile"):
        c = receipt["compile"]
        lines.append(f"  compile_blocks: {sum(c['compiled_blocks'].values())} blocks, {c['graphs_after_first_step']} "
                     f"graphs after step 1, {c['recompiles_after_every_shape']} recompiles once every shape had run, "
                     f"{c['compile_seconds']:.1f} s compiling")
    for effect in receipt["options"]:
        saved, fraction = effect["saved_bytes"], effect["cost_fraction"]
        memory = f"saves {_size(saved)}" if saved >= 0 else f"uses {_size(-saved)} more"
        time = f"costs {fraction:.0%} time" if fraction >= 0 else f"saves {-fraction:.0%} time"
        flag = "  <- no measurable effect" if effect["no_effect"] else ""
        lines.append(f"  {effect['option']}={effect['value']}: {memory}, {time} against {effect['neighbour']}{flag}")
    if receipt.get("note"):
        lines.append(f"  {receipt['note']}")
    return "\n".join(lines)


def _arena_line(arena: dict[str, Any]) -> str:
    """The host arena's line: host memory allocated against used (``report.json`` ``memory.host_arena``)."""
    return (f"  host memory (streamed weights, offloaded activations): {_size(arena['allocated_bytes'])} allocated "
            f"in {arena['chunks']} chunk(s) for {_size(arena['used_bytes'])} used ({arena['ratio']:.3f}x), "
            f"{_size(arena['pinned_bytes'])} pinned")


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.3g} MiB"
