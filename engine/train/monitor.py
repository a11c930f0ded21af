"""What follows each optimizer step of a run, outside its timing: the log line and the step's
record in the history (:class:`StepMonitor`), the watchdog's check (:class:`Watchdog`) and the
validation previews that are due.

The watchdog compares each step's time and peak with the run's own baseline.

Users lose hours to runs that crawl at a fraction of their speed (a driver spilling device memory
into shared system memory: NVIDIA's "CUDA - Sysmem Fallback Policy" on Windows, on by default) or
whose memory creeps up until an out-of-memory error at step N. The watchdog keeps, per batch shape
(a bucket), the median seconds and the largest peak of the first ``baseline_steps`` steps after
the timing warm-up, then:

* a **slowdown**: ``window`` consecutive steps each at least ``factor`` times the baseline median
  of its own shape (default 1.5x for 5 steps; a step of a shape still without a baseline neither
  counts nor breaks the run) is reported once, naming the step it began;
* a **memory growth**: a step's peak above the largest baseline peak of its shape by more than
  :data:`GROWTH` (and :data:`GROWTH_BYTES`) is reported once.

Each report names the likely cause: device memory at capacity (host spill), the validation
previews that ran just before, a new bucket (no baseline of that shape yet), or other load on the
machine, and the setting that would help.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import GuardrailsConfig
from ..families.limits import token_count
from .previews import PREVIEW_FOLDER, PreviewSource, previews_at, run_previews
from .records import StepRecord

GROWTH = 0.05
"""Relative peak growth (over the baseline of the same shape) that counts as memory growth."""
GROWTH_BYTES = 1 << 20
"""Absolute peak growth, bytes, below which a change is noise (the CPU tracker counts every tensor)."""


@dataclass
class _Shape:
    seconds: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    def baseline(self, size: int) -> tuple[float, int] | None:
        if len(self.seconds) < size:
            return None
        return statistics.median(self.seconds[:size]), max(self.peaks[:size])


@dataclass
class Watchdog:
    """Per-step checks of one run.

    Args:
        warmup: steps left out before the baseline (the run's ``timing_warmup_steps``).
        factor: a step this many times slower than the baseline counts as slow (0 = off).
        window: consecutive slow steps that make a slowdown.
        baseline_steps: steps of a shape that make its baseline.
        at_capacity: ``() -> bool``, whether device memory is (nearly) full right now (on CUDA:
            free memory under 5% of the total); default: never.
    """

    warmup: int = 2
    factor: float = 1.5
    window: int = 5
    baseline_steps: int = 3
    at_capacity: Callable[[], bool] = lambda: False
    reports: list[dict[str, Any]] = field(default_factory=list)
    _shapes: dict[str, _Shape] = field(default_factory=dict)
    _seen: int = 0
    _reported: set = field(default_factory=set)
    _previews_at: int | None = None
    _slow: list[tuple[int, float]] = field(default_factory=list)  # the current run of (step, ratio)

    def previews_ran(self, step: int) -> None:
        """Validation previews ran after ``step`` (their allocations and time follow it)."""
        self._previews_at = step

    def observe(self, step: int, seconds: float, peak_bytes: int, shape: str) -> list[dict[str, Any]]:
        """Record one step (``seconds`` and ``peak_bytes`` as measured, ``shape`` a key of its batch
        shape); returns the reports it triggers (each at most once per run)."""
        self._seen += 1
        if self.factor <= 0 or self._seen <= self.warmup:
            return []
        entry = self._shapes.setdefault(shape, _Shape())
        base = entry.baseline(self.baseline_steps)
        if base is None:
            entry.seconds.append(seconds)
            entry.peaks.append(peak_bytes)
            return []
        median, peak = base
        found = []
        # consecutive steps of the run, each against its own shape's baseline (buckets alternate)
        if seconds >= self.factor * median:
            self._slow.append((step, seconds / median))
            if len(self._slow) >= self.window and "slowdown" not in self._reported:
                ratio = statistics.median(r for _, r in self._slow)
                found.append(self._slowdown(self._slow[0][0], step, ratio, median, shape))
        else:
            self._slow.clear()
        if peak_bytes > peak * (1 + GROWTH) and peak_bytes - peak > GROWTH_BYTES and "memory" not in self._reported:
            found.append(self._growth(step, peak_bytes, peak, shape))
        self.reports += found
        return found

    def _cause(self, began: int) -> tuple[str, str]:
        if self.at_capacity():
            return ("device memory is at capacity: the driver is likely spilling to shared system memory (host "
                    "spill)", "a schedule that saves memory (segckpt plan --budget, or a cheaper backend), or turn "
                    "the driver's sysmem fallback off so that an out-of-memory error (recovered by on_oom=switch) "
                    "replaces the crawl")
        if self._previews_at is not None and self._previews_at in (began - 1, began):
            return ("the validation previews that ran after step "
                    f"{self._previews_at}", "fewer previews (validation_every) or fewer validation_num_inference_steps")
        return ("other load on the machine (another process, thermal throttling) or the data pipeline",
                "check what else runs on the device; on a shared CPU, OMP_NUM_THREADS=1")

    def _slowdown(self, began: int, step: int, ratio: float, median: float, shape: str) -> dict[str, Any]:
        self._reported.add("slowdown")
        cause, helps = self._cause(began)
        return {"kind": "slowdown", "step": began, "detected_at": step, "ratio": round(ratio, 2),
                "baseline_seconds": median, "shape": shape, "cause": cause, "helps": helps,
                "message": f"slowdown from step {began}: {ratio:.2f}x the first steps' time (median of "
                           f"{len(self._slow)} slow steps in a row; {median:.3f} s/step for {shape}); likely cause: {cause}; what helps: {helps}"}

    def _growth(self, step: int, peak: int, baseline: int, shape: str) -> dict[str, Any]:
        self._reported.add("memory")
        if self._previews_at is not None and self._previews_at < step:
            cause, helps = (f"the validation previews after step {self._previews_at} left memory allocated",
                            "fewer previews (validation_every)")
        elif self.at_capacity():
            cause, helps = ("device memory is at capacity", "a schedule that saves memory")
        else:
            cause, helps = ("memory kept from step to step (tensors held across steps) or allocator "
                            "fragmentation", "report it with report.json; a cheaper schedule leaves more headroom")
        return {"kind": "memory", "step": step, "peak_bytes": peak, "baseline_peak_bytes": baseline,
                "shape": shape, "cause": cause, "helps": helps,
                "message": f"peak memory grew at step {step}: {peak / 2**20:.1f} MiB against "
                           f"{baseline / 2**20:.1f} MiB in the first steps of the same shape; likely cause: {cause}; "
                           f"what helps: {helps}"}


def device_at_capacity(device: torch.device) -> Callable[[], bool]:
    """Whether the device's memory is nearly full (CUDA: under 5% free); never on the CPU."""
    if device.type != "cuda":
        return lambda: False

    def check() -> bool:
        free, total = torch.cuda.mem_get_info(device)
        return free < 0.05 * total
    return check


STALL_SHARE = 0.25
"""Share of a step spent waiting on weight copies above which a run says so (once)."""


class StepMonitor:
    """Logs, records, watches and previews each step of one run (the run's steps, seed, data and
    validation options are read from the step's context: a switch may have changed its schedule).

    Args:
        guards: the run's guardrails (the watchdog's options). warmup_steps: ``timing_warmup_steps``.
        device: the training device. output: the output folder (previews go under it).
        preview_source: what the previews sample from (None: no previews).
        log: where lines go. writer: whether this process writes the preview files.
    """

    def __init__(self, guards: GuardrailsConfig, warmup_steps: int, device: torch.device, output: Path,
                 preview_source: PreviewSource | None, log: Callable[[str], None], writer: bool):
        self.warmup_steps, self.output, self.source, self.log, self.writer = warmup_steps, output, preview_source, log, writer
        self.watchdog = Watchdog(warmup_steps, guards.watchdog_slowdown, guards.watchdog_window,
                                 at_capacity=device_at_capacity(device))
        self.validation_peak = 0
        self.stall_warned = False

    def after(self, ctx, record: StepRecord, history: list[dict[str, Any]]) -> None:
        """The step's log line, the watchdog's reports and the previews due after it; then the
        record, flat (:meth:`~.records.StepRecord.to_dict`), appended to ``history``."""
        config, memory, streaming = ctx.config, record.memory, record.streaming
        offload = (f"  offload {record.checkpointing.offloaded_bytes / 2**20:.1f} MiB, "
                   f"pool {record.checkpointing.pool_bytes / 2**20:.1f} MiB" if ctx.runner.offloader else "")
        if ctx.runner.streamer:
            offload += (f"  weights in {streaming.weight_h2d_bytes / 2**20:.1f} MiB ({streaming.weight_copies} copies, "
                        f"stall {streaming.weight_stall_s:.3f} s), device peak {memory.device_peak_bytes / 2**20:.1f} MiB "
                        f"with {streaming.resident_frozen_bytes / 2**20:.1f} MiB frozen resident")
        clip = " (clipped)" if record.clipped else ""
        dropped = f"  captions dropped {record.dropped_captions}" if config.data.caption_dropout else ""
        self.log(f"step {record.step:>4}/{config.steps}  loss {record.loss:.4f}  lr {record.lr:.2e}  "
                 f"grad norm {record.grad_norm:.3g}{clip}{dropped}  {record.timing.seconds:.3f} s/step  "
                 f"peak {memory.peak_bytes / 2**20:.1f} MiB{offload}")
        if record.skipped:
            self.log(f"step {record.step}: update skipped: {record.skipped}")
        shape = "x".join(map(str, ctx.batch_shape))
        record.watchdog = self.watchdog.observe(record.step, record.timing.seconds, memory.peak_bytes, shape)
        for found in record.watchdog:
            self.log(f"segckpt: warning: {found['message']}")
        self._stall(ctx, record)
        self._previews(ctx, record)
        # the receipt's peak per phase; latent tokens per sample: latent frames x patches per frame
        # (report.json, the receipt)
        tokens = token_count(ctx.family, dict(getattr(ctx.model, "config", {}) or {}),
                             tuple(ctx.batch_shape[1:])) if len(ctx.batch_shape) >= 4 else 0
        history.append({**record.to_dict(), "shape": shape, "tokens": tokens})

    def _stall(self, ctx, record: StepRecord) -> None:
        """Say once per run when compute waited on weight copies for over a quarter of a step
        (after the timing warm-up)."""
        stall, seconds = record.streaming.weight_stall_s, record.timing.seconds
        if (self.stall_warned or not ctx.runner.streamer or record.step <= self.warmup_steps
                or stall <= STALL_SHARE * seconds):
            return
        self.stall_warned = True
        self.log(f"segckpt: warning: step {record.step} waited {stall:.3f} s of {seconds:.3f} s "
                 f"({stall / seconds:.0%}) on weight copies: stream fewer blocks (weight_offload_blocks), copy further "
                 "ahead (weight_offload_prefetch), or use a schedule with more compute per streamed block (a larger "
                 "interval)")

    def _previews(self, ctx, record: StepRecord) -> None:
        """Sample and save the previews due after ``record``'s step; their paths go in the record."""
        config = ctx.config
        validation = config.validation
        if self.source is None or not previews_at(record.step, validation.validation_every, config.steps):
            return
        paths, peak = run_previews(ctx, self.source, validation.validation_num_inference_steps, config.seed,
                                   self.output / PREVIEW_FOLDER, record.step, write=self.writer)
        self.validation_peak = max(self.validation_peak, peak)
        self.watchdog.previews_ran(record.step)
        record.previews = [p.relative_to(self.output).as_posix() for p in paths]
        self.log(f"step {record.step}: previews {', '.join(record.previews)}")
