"""Slowdown and memory-growth watchdog: each step's time and peak against the run's own baseline.

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
from typing import Any

import torch

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
