"""Pre-flight verdict: will a run fit its memory budget in every phase, under its own schedule?

The same settings that fit one bucket do not fit another (measured on an H200 with a full-size
Flux.1-dev transformer: 23.0 to 41.3 GiB across schedules at 1024 px, 24.7 to 91.8 GiB at 2048 px),
and the first validation or the largest bucket is where runs die at step N. Before step 1 the
pre-flight therefore probes one step per distinct batch shape of the data (each bucket, the
largest first; :func:`~.probe.probe`, one step without checkpointing, measured exactly like a
sweep cell), plus the preview phase when previews are on (sampled once in the largest bucket's
probe run), and predicts with the planner's model (:func:`~.planner.predict`) the peak of every
training phase under the run's schedule. A phase fits when its predicted peak is at most the
budget less the planner's headroom (:data:`~.planner.MARGIN`); the preview phase runs without
gradients, so its measured peak is the same under every schedule. When a phase does not fit, the
verdict names the schedule predicted to fit every training phase that is fastest over the run's
mix of shapes (the planner's choice across buckets). A run predicted not to fit does not start
unless the user overrides it (:class:`PreflightRefused`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ..config import MeasureConfig
from ..config.schedule import CheckpointSchedule, ScheduleError, check_supported
from ..core.arena import planned_total
from ..data.buckets import shape_classes
from ..families import get_family
from ..families.limits import token_count
from .frames import use_frames
from .planner import MARGIN, NOT_STREAMED, TIE, Prediction, fewest_streamed, predict, preference, streaming_helps
from .probe import Probe, first_probe_steps, plain_steps, probe, probe_steps
from .runs import RunWorkspace
from .sweep import sweep_schedules


class PreflightRefused(ValueError):
    """The run is predicted not to fit its budget: the message is the verdict (phases, the schedule
    that would fit) and how to start anyway."""


@dataclass
class Phase:
    """One phase of a run and its predicted peak.

    Attributes:
        kind: ``train`` (steps of one batch shape) or ``validation`` (the preview phase).
        shape: the batch's latent shape ``B x C x h x w`` (training), or ``""``.
        share: the fraction of the epoch's samples of this shape (training), or 0.
        peak_bytes: predicted peak (training, under the verdict's schedule) or measured peak
            (validation), bytes, in the scope of the run's own peaks.
        fits: ``peak_bytes`` is within the budget less the headroom.
    """

    kind: str
    shape: str
    share: float
    peak_bytes: int
    fits: bool
    frames: int = 1
    """Pixel frames of the shape (``C x F' x h x w`` latents: ``rule.pixel_frames(F')``; 1 for images)."""
    tokens: int = 0
    """Latent tokens per sample (latent frames x patches per frame), 0 when not known."""

    @property
    def name(self) -> str:
        return f"train {self.shape}" if self.kind == "train" else "validation previews"

    @property
    def detail(self) -> str:
        """``5 frames, 128 tokens`` (the frames only for clips), or ``""``."""
        parts = ([f"{self.frames} frames"] if self.frames > 1 else []) + ([f"{self.tokens} tokens"] if self.tokens else [])
        return ", ".join(parts)


@dataclass
class Verdict:
    """The pre-flight's answer for one schedule and budget.

    Attributes:
        budget_bytes: the budget. schedule: the run's schedule. phases: every phase, largest
            training shape first, then validation. suggestion: the schedule predicted to fit every
            training phase, fastest over the shapes' mix (None when the run fits, or nothing
            fits). suggested: the phases under ``suggestion``. probes: the probe per shape.
            notes: what else the user should know (nothing fits; the preview phase alone does
            not fit).
    """

    budget_bytes: int
    schedule: CheckpointSchedule
    phases: list[Phase]
    suggestion: CheckpointSchedule | None = None
    suggested: list[Phase] = field(default_factory=list)
    probes: dict[str, Probe] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    """Host memory the schedule keeps (streamed weights' host copies as allocated, offloaded activations), bytes."""
    streamed_bytes: int = 0
    host_budget_bytes: int | None = None

    @property
    def host_fits(self) -> bool:
        """The host memory the schedule keeps fits the host budget (True without one)."""
        return self.host_budget_bytes is None or self.host_bytes <= self.host_budget_bytes

    @property
    def fits(self) -> bool:
        """Every phase fits, on the device and on the host."""
        return all(p.fits for p in self.phases) and self.host_fits

    def render(self) -> str:
        """The verdict as lines: one per phase, then the schedule that would fit."""
        head = "fits" if self.fits else "does NOT fit"
        lines = [f"pre-flight: {self.schedule.mode} {head} in {self.budget_bytes / 2**30:.4g} GiB "
                 f"(less {MARGIN:.0%} headroom; {PEAK_SCOPE})"]
        for phase in self.phases:
            share = f", {phase.share:.0%} of the samples" if phase.kind == "train" else ""
            share += f" ({phase.detail})" if phase.kind == "train" and phase.detail else ""
            lines.append(f"  {'ok ' if phase.fits else 'NO '} {phase.name:<34} {_gib(phase.peak_bytes)}{share}")
        host = f" of {_gib(self.host_budget_bytes)} host budget" if self.host_budget_bytes is not None else ""
        if self.host_bytes or self.host_budget_bytes is not None:  # nothing waits on the host otherwise
            chunks = planned_total(self.streamed_bytes)  # as allocated: the host arena's chunks
            lines.append(f"  {'ok ' if self.host_fits else 'NO '} {'host memory':<34} {_gib(self.host_bytes)}{host} "
                         f"(streamed weights {_gib(self.streamed_bytes)} in {_gib(chunks)} of host chunks, "
                         f"offloaded activations {_gib(self.host_bytes - chunks)})")
        if self.suggestion is not None:
            peaks = ", ".join(f"{p.name} {_gib(p.peak_bytes)}" for p in self.suggested if p.kind == "train")
            lines.append(f"  fits: {self.suggestion.mode} ({peaks}); its keys: "
                         + ", ".join(f"{k}={v}" for k, v in self.suggestion.to_dict().items()))
        lines.extend(f"  {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``report.json`` ``preflight``)."""
        return {"budget_bytes": self.budget_bytes, "schedule": self.schedule.mode, "fits": self.fits,
                "peak_scope": PEAK_SCOPE,
                "phases": [_phase_dict(p) for p in self.phases],
                "suggestion": self.suggestion.to_dict() if self.suggestion else None,
                "suggestion_mode": self.suggestion.mode if self.suggestion else None,
                "suggested_phases": [_phase_dict(p) for p in self.suggested], "notes": self.notes,
                "host_bytes": self.host_bytes, "streamed_bytes": self.streamed_bytes,
                "host_budget_bytes": self.host_budget_bytes, "host_fits": self.host_fits}


PEAK_SCOPE = "each peak counts what the device holds: weights, LoRA and optimizer state included"
"""What a phase's peak is, on every device (the CPU tracker's step peak plus what it leaves out)."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.4g} GiB" if n >= 2**28 else f"{n / 2**20:.4g} MiB"


def _phase_dict(p: Phase) -> dict[str, Any]:
    return {"phase": p.name, "kind": p.kind, "shape": p.shape, "share": p.share, "peak_bytes": p.peak_bytes,
            "fits": p.fits, "frames": p.frames, "tokens": p.tokens}


def _fits(peak: int, budget: int) -> bool:
    return peak <= budget * (1 - MARGIN)


def training_phases(probes: dict[str, Probe], shares: dict[str, float], schedule: CheckpointSchedule,
                    budget_bytes: int, sizes: dict[str, tuple[int, int]] | None = None) -> list[Phase]:
    """The predicted training phases of ``schedule`` (one per probed shape); ``sizes``: per shape
    key, (pixel frames, tokens per sample)."""
    phases = []
    for key, measured in probes.items():
        peak = predict(measured, schedule).peak_bytes
        frames, tokens = (sizes or {}).get(key, (1, 0))
        phases.append(Phase("train", key, shares[key], peak, _fits(peak, budget_bytes), frames, tokens))
    return phases


def shape_size(bundle, shape: tuple[int, ...]) -> tuple[int, int]:
    """(pixel frames, latent tokens) of one sample's latent ``shape`` (``(C, h, w)``, ``(C, 1, h, w)``
    or ``(C, F', h, w)``): frames through the family's rule, tokens by
    :func:`~..families.limits.token_count`."""
    rule = bundle.family.frames
    frames = rule.pixel_frames(shape[1]) if rule is not None and len(shape) == 4 else 1
    return frames, token_count(bundle.family, dict(bundle.transformer.config), shape)


def suggest(probes: dict[str, Probe], shares: dict[str, float], budget_bytes: int,
            candidates: list[CheckpointSchedule] | None = None,
            stream: bool = False) -> tuple[CheckpointSchedule | None, str | None]:
    """The schedule predicted to fit every shape that is fastest over the shapes' mix (predicted
    sec/step weighted by each shape's share; ties within the planner's ``TIE`` follow the
    documents' rule), or ``(None, why)`` when none fits. Streaming is suggested as the planner
    chooses it (:func:`~.planner.choose`: on the CPU only when ``stream``, the user's schedule
    streams)."""
    family = get_family(next(iter(probes.values())).family)
    scored: list[tuple[float, CheckpointSchedule]] = []
    smallest: Prediction | None = None
    for schedule in candidates or sweep_schedules():
        try:
            check_supported(family, schedule)
        except ScheduleError:
            continue
        predictions = {key: predict(p, schedule) for key, p in probes.items()}
        worst = max(predictions.values(), key=lambda p: p.peak_bytes)
        if smallest is None or worst.peak_bytes < smallest.peak_bytes:
            smallest = worst
        if all(_fits(p.peak_bytes, budget_bytes) for p in predictions.values()):
            scored.append((sum(shares[k] * p.sec_per_step for k, p in predictions.items()), schedule))
    if not scored and candidates is None:  # nothing fits with the weights on the device: stream them
        largest = max(probes.values(), key=lambda p: p.peak_bytes)
        streamed = [q.schedule for s in sweep_schedules()
                    for q in _fewest(largest, family, s, budget_bytes * (1 - MARGIN), stream)]
        if streamed:
            return suggest(probes, shares, budget_bytes, streamed, stream)
    if not scored:
        return None, (f"no schedule is predicted to fit every shape: the smallest predicted peak is "
                      f"{_gib(smallest.peak_bytes)} ({smallest.schedule.mode}); lower the resolution or batch size"
                      + ("" if stream or streaming_helps(next(iter(probes.values()))) else f"; {NOT_STREAMED}"))
    fastest = min(t for t, _ in scored)
    return min((s for t, s in scored if t <= fastest * (1 + TIE)), key=preference), None


def _fewest(probe_: Probe, family, schedule: CheckpointSchedule, limit: float, asked: bool) -> list[Prediction]:
    """:func:`~.planner.fewest_streamed` of a schedule the family can run (else nothing)."""
    try:
        check_supported(family, schedule)
    except ScheduleError:
        return []
    return fewest_streamed(probe_, schedule, limit, asked)


def preflight(workspace: RunWorkspace, budget_bytes: int, measure: MeasureConfig | None = None, *,
              host_budget_bytes: int | None = None) -> Verdict:
    """Probe every batch shape of the run's data (and the preview phase) and judge the run's
    schedule against ``budget_bytes``.

    Args:
        workspace: the run to judge, not open (:class:`~.runs.RunWorkspace`: its settings - data,
            resolution, batch, schedule, previews, device, ...; the model, never changed: probes
            train deep copies; ComfyUI's latents and text when the run trains on them; its
            ``on_step`` is also called with ``(0, 0)`` before the data is encoded and ``(0, K)``
            before the first of the ``K`` probe steps); opened here for the probes.
        budget_bytes: the memory budget, bytes.
        measure: ``warmup_steps`` (probe steps before the measured one) and ``frames``: pixel-frame
            counts (checked by :func:`~.frames.check_measure_frames`) to judge instead of the data's
            shapes: one phase per count, on synthetic clips of the run's square resolution
            (:func:`~.frames.use_frames`), equal shares. Default: the defaults.
        host_budget_bytes: the host memory the streamed weights and offloaded activations may use.

    Raises:
        MeasurementInterrupted: ``should_stop`` answered True.
    """
    measure = measure or MeasureConfig()
    with workspace:
        probed = _probe_shapes(workspace, measure)
    config = workspace.config
    return _verdict(config.schedule, bool(config.validation.validation_every), budget_bytes, host_budget_bytes,
                    *probed)


def _probe_shapes(workspace: RunWorkspace,
                  measure: MeasureConfig) -> tuple[dict[str, Probe], dict[str, float], dict[str, tuple[int, int]]]:
    """One probe per batch shape (the first calibrates the offloader for the others): ``(probes,
    shares, sizes)`` by shape key (see :func:`preflight`)."""
    warmup_steps, config, bundle = measure.warmup_steps, workspace.config, workspace.bundle
    workspace.report()  # (0, 0): encoding the data
    counts = measure.frames or (None,)
    classes = {n: _classes(workspace, n) for n in counts}
    probed = sum(len(c) for c in classes.values())
    workspace.expect(first_probe_steps(workspace, warmup_steps) + (probed - 1) * probe_steps(warmup_steps, calibrate=False))
    workspace.report()  # (0, K): probing starts
    probes: dict[str, Probe] = {}
    shares: dict[str, float] = {}
    sizes: dict[str, tuple[int, int]] = {}
    calibration = None
    for n in counts:
        total = sum(len(rows) for _, rows in classes[n])
        with use_frames(workspace, n) if n is not None else contextlib.nullcontext():
            for shape, rows in classes[n]:
                key = "x".join(map(str, (config.data.batch_rows()[1], *shape)))
                # the preview phase is sampled once, after the largest shape's last probe step
                previews = {"validation_every": plain_steps(warmup_steps), "validation_num_inference_steps": 1} \
                    if not probes and config.validation.validation_every else {}
                measured = probe(workspace, warmup_steps, rows=rows, calibration=calibration, **previews)
                calibration = measured.calibration
                probes[key], shares[key] = measured, len(rows) / total / len(counts)
                sizes[key] = shape_size(bundle, shape)
    return probes, shares, sizes


def _verdict(schedule: CheckpointSchedule, previews: bool, budget_bytes: int, host_budget_bytes: int | None,
             probes: dict[str, Probe], shares: dict[str, float], sizes: dict[str, tuple[int, int]]) -> Verdict:
    """The verdict of the run's ``schedule`` on the probed shapes (and the preview phase, when the run
    samples ``previews``), with the schedule that would fit when a training phase does not."""
    phases = training_phases(probes, shares, schedule, budget_bytes, sizes)
    on_host = [predict(measured, schedule) for measured in probes.values()]
    verdict = Verdict(budget_bytes, schedule, phases, probes=probes,
                      host_bytes=max(p.host_bytes for p in on_host), streamed_bytes=max(p.streamed_bytes for p in on_host),
                      host_budget_bytes=host_budget_bytes)
    validation = next(iter(probes.values())).validation_peak_bytes
    if previews and validation:
        phases.append(Phase("validation", "", 0.0, validation, _fits(validation, budget_bytes)))
        if not phases[-1].fits:
            verdict.notes.append("the preview phase alone does not fit (it runs without gradients: no schedule "
                                 "changes it): fewer validation prompts, or validation_every 0")
    if not all(p.fits for p in phases if p.kind == "train"):
        verdict.suggestion, why = suggest(probes, shares, budget_bytes, stream=schedule.streams)
        if verdict.suggestion is not None:
            verdict.suggested = training_phases(probes, shares, verdict.suggestion, budget_bytes, sizes)
        else:
            verdict.notes.append(why)
    return verdict


def _classes(workspace: RunWorkspace, frames: int | None) -> list[tuple[tuple[int, ...], list[int]]]:
    """The batch shapes to probe: the data's (``frames`` None), or the one shape of the synthetic
    clips of ``frames`` pixel frames."""
    if frames is None:
        return shape_classes(workspace.data_cache())
    with use_frames(workspace, frames) as clips:
        return shape_classes(clips.cache)
