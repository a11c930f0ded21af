"""What follows each optimizer step of a run, outside its timing: the log line, the watchdog's
check and the validation previews that are due."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..config import TrainConfig
from ..families.limits import token_count
from .previews import PREVIEW_FOLDER, PreviewSource, previews_at, run_previews
from .step import StepRecord
from .watchdog import Watchdog, device_at_capacity

STALL_SHARE = 0.25
"""Share of a step spent waiting on weight copies above which a run says so (once)."""


class StepMonitor:
    """Logs, watches and previews each step of one run.

    Args:
        config: the run's config (steps, validation, guardrails, seed).
        device: the training device. output: the output folder (previews go under it).
        preview_source: what the previews sample from (None: no previews).
        log: where lines go. writer: whether this process writes the preview files.
    """

    def __init__(self, config: TrainConfig, device, output: Path, preview_source: PreviewSource | None,
                 log: Callable[[str], None], writer: bool):
        guards = config.guards
        self.config, self.output, self.source, self.log, self.writer = config, output, preview_source, log, writer
        self.watchdog = Watchdog(config.timing_warmup_steps, guards.watchdog_slowdown, guards.watchdog_window,
                                 at_capacity=device_at_capacity(device))
        self.validation_peak = 0
        self.stall_warned = False

    def after(self, ctx, record: StepRecord, history: list[dict[str, Any]]) -> None:
        """The step's log line and record, the watchdog's reports and the previews due after it."""
        history.append(vars(record))
        offload = (f"  offload {record.offloaded_bytes / 2**20:.1f} MiB, pool {record.pool_bytes / 2**20:.1f} MiB"
                   if ctx.runner.offloader else "")
        if ctx.runner.streamer:
            offload += (f"  weights in {record.weight_h2d_bytes / 2**20:.1f} MiB ({record.weight_copies} copies, "
                        f"stall {record.weight_stall_s:.3f} s), device peak {record.device_peak_bytes / 2**20:.1f} MiB "
                        f"with {record.resident_frozen_bytes / 2**20:.1f} MiB frozen resident")
        clip = " (clipped)" if record.clipped else ""
        dropped = f"  captions dropped {record.dropped_captions}" if self.config.data.caption_dropout else ""
        self.log(f"step {record.step:>4}/{self.config.steps}  loss {record.loss:.4f}  lr {record.lr:.2e}  "
                 f"grad norm {record.grad_norm:.3g}{clip}{dropped}  {record.seconds:.3f} s/step  "
                 f"peak {record.peak_bytes / 2**20:.1f} MiB{offload}")
        if record.skipped:
            self.log(f"step {record.step}: update skipped: {record.skipped}")
        shape = "x".join(map(str, ctx.batch_shape))
        history[-1]["shape"] = shape  # the receipt's peak per phase (the record's own dict)
        # latent tokens per sample: latent frames x patches per frame (report.json, the receipt)
        history[-1]["tokens"] = token_count(ctx.family, dict(getattr(ctx.model, "config", {}) or {}),
                                            tuple(ctx.batch_shape[1:])) if len(ctx.batch_shape) >= 4 else 0
        record.watchdog = self.watchdog.observe(record.step, record.seconds, record.peak_bytes, shape)
        for found in record.watchdog:  # the history entry is the record's own dict: it has them too
            self.log(f"segckpt: warning: {found['message']}")
        self._stall(ctx, record)
        self._previews(ctx, record)

    def _stall(self, ctx, record: StepRecord) -> None:
        """Say once per run when compute waited on weight copies for over a quarter of a step
        (after the timing warm-up)."""
        if (self.stall_warned or not ctx.runner.streamer or record.step <= self.config.timing_warmup_steps
                or record.weight_stall_s <= STALL_SHARE * record.seconds):
            return
        self.stall_warned = True
        share = record.weight_stall_s / record.seconds
        self.log(f"segckpt: warning: step {record.step} waited {record.weight_stall_s:.3f} s of {record.seconds:.3f} s "
                 f"({share:.0%}) on weight copies: stream fewer blocks (weight_offload_blocks), copy further ahead "
                 "(weight_offload_prefetch), or use a schedule with more compute per streamed block (a larger interval)")

    def _previews(self, ctx, record: StepRecord) -> None:
        """Sample and save the previews due after ``record``'s step; their paths go in the record."""
        validation = self.config.validation
        if self.source is None or not previews_at(record.step, validation.validation_every, self.config.steps):
            return
        paths, peak = run_previews(ctx, self.source, validation.validation_num_inference_steps, self.config.seed,
                                   self.output / PREVIEW_FOLDER, record.step, write=self.writer)
        self.validation_peak = max(self.validation_peak, peak)
        self.watchdog.previews_ran(record.step)
        record.previews = [p.relative_to(self.output).as_posix() for p in paths]  # also in the history entry
        self.log(f"step {record.step}: previews {', '.join(record.previews)}")
