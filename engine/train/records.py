"""What one optimizer step reports: :class:`StepRecord`, its outcome flat and its measurements in
named groups (timing, memory, checkpointing, streaming, saving, compile), as torchtitan groups its
metrics. ``report.json``'s per-step entries, the saved state's history and the nodes read the
groups' fields flat (:meth:`StepRecord.to_dict`): their keys are the ones saved reports hold."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class StepTiming:
    """How long the step took.

    Attributes:
        seconds: wall time of the step (the micro-batches, the gradients' clipping and the
            optimizer update; the batches' drawing and the monitor's work after it excluded).
    """

    seconds: float = 0.0


@dataclass
class StepMemory:
    """The step's memory (``engine/core/memory.py``; report.py says what a peak counts).

    Attributes:
        peak_bytes: peak memory of the step.
        start_bytes: memory allocated when the step began (CUDA; 0 on the CPU, whose tracker
            counts only what the step creates): ``peak_bytes - start_bytes`` is the step's own
            activation and gradient memory.
        device_peak_bytes: the step's peak with everything the device holds: on CUDA
            ``peak_bytes``; on the CPU ``peak_bytes`` plus the frozen bytes resident on the
            "device", the trainable parameters and the optimizer state that existed before the
            step (what a budget is compared with).
    """

    peak_bytes: int = 0
    start_bytes: int = 0
    device_peak_bytes: int = 0


@dataclass
class StepCheckpointing:
    """The runner's and the offloader's counters of the step.

    Attributes:
        checkpoint_calls, recomputed_blocks, recomputed_ffn: the runner's counters.
        offloaded_tensors, offloaded_bytes: what went to host memory this step.
        pool_bytes, pool_buckets: the host pool's size and distinct (size, dtype) keys after it.
    """

    checkpoint_calls: int = 0
    recomputed_blocks: int = 0
    recomputed_ffn: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    pool_bytes: int = 0
    pool_buckets: int = 0


@dataclass
class StepStreaming:
    """Weight streaming's and the host arena's figures of the step
    (:meth:`~..core.runner.SegmentRunner.weight_receipt`, which says what each counts).

    Attributes:
        weight_h2d_bytes, weight_copies, weight_d2h_bytes, weight_stall_s: the weight copies.
        resident_frozen_bytes, streamed_frozen_bytes: frozen bytes on the device and on the host.
        pinned_host_bytes, host_arena_bytes, host_arena_used_bytes, host_arena_chunks: the host arena.
    """

    weight_h2d_bytes: int = 0
    weight_copies: int = 0
    weight_d2h_bytes: int = 0
    weight_stall_s: float = 0.0
    resident_frozen_bytes: int = 0
    streamed_frozen_bytes: int = 0
    pinned_host_bytes: int = 0
    host_arena_bytes: int = 0
    host_arena_used_bytes: int = 0
    host_arena_chunks: int = 0


@dataclass
class StepSaving:
    """``gradient_checkpointing_save_attention``'s counts of the step
    (:class:`~..core.attention_saving.AttentionStats`; all 0 without it)."""

    saved_attention_outputs: int = 0
    saved_attention_bytes: int = 0
    recomputed_attention_calls: int = 0
    unsaved_attention_regions: int = 0


@dataclass
class StepCompile:
    """``compile_blocks``' count through the step.

    Attributes:
        compiled_graphs: the graphs compiled since the run set up compiling (a step that adds
            some recompiled).
    """

    compiled_graphs: int = 0


RECORD_GROUPS = ("timing", "memory", "checkpointing", "streaming", "saving", "compile")
"""The grouped fields of :class:`StepRecord`, as torchtitan groups its metrics; ``report.json``'s
per-step entries hold their fields flat (:meth:`StepRecord.to_dict`)."""


@dataclass
class StepRecord:
    """One optimizer step: its outcome flat, its measurements in named groups
    (:data:`RECORD_GROUPS`).

    Attributes:
        step: 1-based optimizer step. loss: mean loss over the micro-batches. lr: learning rate.
        grad_norm: the LoRA gradients' total L2 norm before clipping (after fp16 unscaling; NaN or
            inf when not finite). clipped: ``max_grad_norm`` scaled the gradients down this step.
        skipped: why the update of this step was dropped (``on_nonfinite=skip``, or an fp16
            loss-scale overflow), else None.
        dropped_captions: samples of the step (all micro-batches, the global batch) that trained
            with the empty caption (``caption_dropout``).
        noise_levels, sample_losses: each sample of the step's global batch (micro-batches in order): its
            noise level (flow sigma; epsilon ``t / 1000``) and its unweighted mean squared error
            (``report.json``'s ``loss_by_noise_level`` bins them).
        previews: preview images sampled after this step (paths relative to the output folder).
        schedule_switches: out-of-memory recoveries of this step (``{"step", "from", "to", "error",
            ...}``): it ran again under the schedule ``to``.
        watchdog: the watchdog's reports made after this step (``{"kind", "step", "message", ...}``).
        timing, memory, checkpointing, streaming, saving, compile: the step's measurements.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float = 0.0
    clipped: bool = False
    skipped: str | None = None
    dropped_captions: int = 0
    noise_levels: list[float] = field(default_factory=list)
    sample_losses: list[float] = field(default_factory=list)
    previews: list[str] = field(default_factory=list)
    schedule_switches: list[dict] = field(default_factory=list)
    watchdog: list[dict] = field(default_factory=list)
    timing: StepTiming = field(default_factory=StepTiming)
    memory: StepMemory = field(default_factory=StepMemory)
    checkpointing: StepCheckpointing = field(default_factory=StepCheckpointing)
    streaming: StepStreaming = field(default_factory=StepStreaming)
    saving: StepSaving = field(default_factory=StepSaving)
    compile: StepCompile = field(default_factory=StepCompile)

    def to_dict(self) -> dict[str, Any]:
        """The record as ``report.json``'s per-step entry: the groups' fields flat beside the
        step's own (the keys saved reports, the saved state's history and the nodes read)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RECORD_GROUPS}
        for group in RECORD_GROUPS:
            flat.update(vars(getattr(self, group)))
        return flat
