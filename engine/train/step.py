"""One optimizer step of a training run, read top to bottom, and the learning-rate schedule.

A step: set the learning rate -> for each micro-batch: noise the cached latents, the captions'
conditioning (some replaced by the empty caption's, ``caption_dropout``), forward (under autocast
and the run's SDPA kernels), loss, backward (checkpointed regions recompute here, and offloaded
inputs come back) -> fp16 unscaling, the gradients' norm and clipping (``max_grad_norm``) -> the
non-finite guard (one synchronisation, which also reads the norm) -> the optimizer step (or a
skip) -> gradients released.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointError

from ..config import TrainConfig
from ..core.compiling import CompileReport, compiled_graphs
from ..core.memory import PeakMemory, StepTimer
from ..core.plan import ScheduleWarning
from ..core.runner import RecomputeMismatch, SegmentRunner
from ..data.buckets import latents_for
from ..data.samplers import BucketSampler, EpochSampler, caption_dropout
from ..data.windows import RandomWindows
from ..families import FamilyAdapter, TextBatch
from ..families.conditioning import guided_inputs
from ..model.attention_kernels import sdpa_context
from ..model.distributed import Distributed, sync_gradients
from ..model.precision import Precision, tensor_bytes
from .nonfinite import TrainingDiverged, TrainingStopped, check_finite, describe
from .objectives import NoiseSchedule, per_sample_mse
from .optim import clip_gradients, clipped, lr_factor, set_learning_rate


class RecomputeNotRepeatable(TrainingStopped):
    """A checkpointed region computed something else in its recompute than in its forward."""




@dataclass
class StepRecord:
    """One optimizer step.

    Attributes:
        step: 1-based optimizer step. loss: mean loss over the micro-batches. lr: learning rate.
        seconds: wall time of the step. peak_bytes: peak memory of the step (see report.py).
        checkpoint_calls, recomputed_blocks, recomputed_ffn: the runner's counters.
        offloaded_tensors, offloaded_bytes: what went to host memory this step.
        pool_bytes, pool_buckets: the host pool's size and distinct (size, dtype) keys after it.
        start_bytes: memory allocated when the step began (CUDA; 0 on the CPU, whose tracker
            counts only what the step creates): ``peak_bytes - start_bytes`` is the step's own
            activation and gradient memory.
        skipped: why the update of this step was dropped (``on_nonfinite=skip``, or an fp16
            loss-scale overflow), else None.
        previews: preview images sampled after this step (paths relative to the output folder).
        schedule_switches: out-of-memory recoveries of this step (``{"step", "from", "to", "error",
            ...}``): it ran again under the schedule ``to``.
        watchdog: the watchdog's reports made after this step (``{"kind", "step", "message", ...}``).
        weight_h2d_bytes, weight_copies, weight_d2h_bytes, weight_stall_s, resident_frozen_bytes,
            streamed_frozen_bytes, pinned_host_bytes, host_arena_bytes, host_arena_used_bytes,
            host_arena_chunks: weight streaming's and the host arena's figures of the step
            (:meth:`~..core.runner.SegmentRunner.weight_receipt`).
        saved_attention_outputs, saved_attention_bytes, recomputed_attention_calls,
            unsaved_attention_regions: ``gradient_checkpointing_save_attention``'s counts of the
            step (:class:`~..core.attention_saving.AttentionStats`; all 0 without it).
        compiled_graphs: with ``compile_blocks``, the graphs compiled since the run set up
            compiling, through this step (a step that adds some recompiled).
        device_peak_bytes: the step's peak with everything the device holds: on CUDA
            ``peak_bytes``; on the CPU ``peak_bytes`` plus the frozen bytes resident on the
            "device", the trainable parameters and the optimizer state that existed before the
            step (what a budget is compared with).
        grad_norm: the LoRA gradients' total L2 norm before clipping (after fp16 unscaling; NaN or
            inf when not finite). clipped: ``max_grad_norm`` scaled the gradients down this step.
        dropped_captions: samples of the step (all micro-batches, the global batch) that trained
            with the empty caption (``caption_dropout``).
        noise_levels, sample_losses: each sample of the step's global batch (micro-batches in order): its
            noise level (flow sigma; epsilon ``t / 1000``) and its unweighted mean squared error
            (``report.json``'s ``loss_by_noise_level`` bins them).
    """

    step: int
    loss: float
    lr: float
    seconds: float
    peak_bytes: int
    checkpoint_calls: int
    recomputed_blocks: int
    recomputed_ffn: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    pool_bytes: int = 0
    pool_buckets: int = 0
    start_bytes: int = 0
    skipped: str | None = None
    previews: list[str] = field(default_factory=list)
    schedule_switches: list[dict] = field(default_factory=list)
    watchdog: list[dict] = field(default_factory=list)
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
    device_peak_bytes: int = 0
    saved_attention_outputs: int = 0
    saved_attention_bytes: int = 0
    recomputed_attention_calls: int = 0
    unsaved_attention_regions: int = 0
    compiled_graphs: int = 0
    grad_norm: float = 0.0
    clipped: bool = False
    dropped_captions: int = 0
    noise_levels: list[float] = field(default_factory=list)
    sample_losses: list[float] = field(default_factory=list)


@dataclass
class StepContext:
    """What every step of one run uses (built once by the run's set-up)."""

    config: TrainConfig
    model: torch.nn.Module
    family: FamilyAdapter
    runner: SegmentRunner
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: EpochSampler | BucketSampler
    cache: dict[str, torch.Tensor]
    noise_gen: torch.Generator
    device: torch.device
    precision: Precision
    kernels: tuple[str, ...]
    memory: PeakMemory
    timer: StepTimer
    named_params: list[tuple[str, torch.nn.Parameter]]
    epoch: list[int]
    """Cache row of each position of an epoch (a sample appears as often as its repeats)."""
    updating: bool = False
    """True while the optimizer updates the LoRA (an out-of-memory error then cannot be retried)."""
    batch_shape: tuple[int, ...] = ()
    """Latent shape of the last micro-batch, ``(B, C, h, w)`` (the watchdog compares steps of one shape)."""
    dist: Distributed | None = None
    """The process group of a multi-process run (FSDP, DDP): each rank trains its rows of every batch."""
    compiled: CompileReport | None = None
    """``compile_blocks``: what was compiled (the steps count the graphs compiled since)."""
    random_windows: RandomWindows | None = None
    """``frame_sampling=random``: the clips' windows drawn and encoded per batch, before the measured region."""
    noise: NoiseSchedule | None = None
    """How the steps draw noise levels and weight the loss (default: the config's objective, the family's
    declared scheduler config; the run's set-up reads the model folder's)."""
    empty_text: TextBatch | None = None
    """``caption_dropout``: the empty caption's conditioning, ``(1, L, D)`` (``engine/data/prepare.py``)."""
    lr_factor: Callable[[int], float] = field(init=False)
    """The learning-rate multiplier of each step (:func:`~.optim.lr_factor`)."""

    def __post_init__(self) -> None:
        self.lr_factor = lr_factor(self.config.optimizer, self.config.steps)
        if self.noise is None:
            self.noise = NoiseSchedule(self.family, self.config.objective, self.family.flow_shift,
                                       dict(self.model.config))

    def guard_context(self) -> dict[str, Any]:
        """What the non-finite advice needs to know about this run."""
        return {"device": self.device, "precision": self.precision.to_dict(), "attention_backend": self.kernels,
                "learning_rate": self.config.optimizer.learning_rate, "lora_alpha": self.config.lora.alpha,
                "lora_rank": self.config.lora.rank}


def train_step(ctx: StepContext, step: int) -> StepRecord:
    """One optimizer step (``step`` 0-based) over ``gradient_accumulation_steps`` micro-batches.

    Raises:
        TrainingDiverged: a non-finite loss or gradient with ``on_nonfinite=stop`` (before the
            optimizer step: the LoRA weights are untouched).
    """
    config, model, family, runner, device = ctx.config, ctx.model, ctx.family, ctx.runner, ctx.device
    lr = config.optimizer.learning_rate * ctx.lr_factor(step)
    set_learning_rate(ctx.optimizer, lr)
    _reset_stats(runner)
    # optimizer state that exists before the step is held on the device (the CPU tracker misses it)
    held_state = _state_bytes(ctx.optimizer) if device.type != "cuda" else 0
    # the micro-batches' rows and latents (random clip windows are decoded and encoded here, unmeasured)
    batches = [_draw(ctx) for _ in range(config.optimizer.gradient_accumulation_steps)]
    with ctx.memory.measure() as reading, ctx.timer.step():
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        dropped_captions, levels, errors = 0, [], []
        # one SDPA kernel choice for forward, backward and every recompute inside backward
        with sdpa_context(ctx.kernels):
            for micro, (index, latents) in enumerate(batches):
                noisy, sigmas, target = ctx.noise.noisy_latents(latents, ctx.noise_gen, family.shared_sigma)
                dropped = caption_dropout(config.seed, step, micro, len(index), config.data.caption_dropout)
                dropped_captions += int(dropped.sum())
                levels.append(sigmas)
                rows, share = None, 1.0
                if ctx.dist is not None:  # every rank drew the global batch and its noise; it trains its rows
                    rows, share = ctx.dist.share(len(index))
                    index, noisy, sigmas, target = index[rows], noisy[rows], sigmas[rows], target[rows]
                    dropped = dropped[rows]
                text = _text(ctx.cache, index, dropped, ctx.empty_text).to(device)
                noisy, sigmas, target = noisy.to(device), sigmas.to(device), target.to(device)
                ctx.batch_shape = tuple(noisy.shape)
                # ddp: the last micro-batch's backward averages the accumulated gradients over ranks
                with sync_gradients(runner.entry, micro + 1 == len(batches)):
                    with ctx.precision.autocast(device):
                        output = runner.forward(**guided_inputs(family, model, noisy, sigmas, text,
                                                                config.objective.guidance_value))
                        prediction = family.read_output(model, output, noisy)
                    loss = (ctx.noise.loss(prediction, target, sigmas) * share
                            / config.optimizer.gradient_accumulation_steps)
                    # checkpointed regions are recomputed (offloaded inputs copied back) in here
                    try:
                        ctx.scaler.scale(loss).backward()
                    except CheckpointError as exc:
                        raise RecomputeNotRepeatable(_recompute_message(ctx, runner.recompute_mismatch(exc),
                                                                        step + 1)) from exc
                loss_sum += loss.detach()
                # each sample's unweighted error (after backward: its temporary adds nothing to the peak)
                errors.append(_sample_errors(prediction, target, len(levels[-1]), rows, share))
        ctx.scaler.unscale_(ctx.optimizer)  # fp16 loss scaling only; a no-op otherwise
        # the norm before clipping (sharded: the whole model's); gradients scaled to max_grad_norm
        grad_norm = clip_gradients([p for _, p in ctx.named_params], config.optimizer.max_grad_norm)
        errors = torch.cat(errors)
        if ctx.dist is not None:  # the global batch's loss; every rank judges the gradients alike
            loss_sum = ctx.dist.mean(loss_sum)
            errors = ctx.dist.mean(errors) * ctx.dist.world_size  # each row's error is on one rank only
        check = check_finite(loss_sum, ctx.named_params, ctx.dist.all_true if ctx.dist is not None else None,
                             grad_norm)  # the step's one synchronisation
        skipped = _update(ctx, check, step)
        seconds = time.perf_counter() - started
    stats, off = runner.stats, runner.offloader
    if runner.streamer:
        runner.streamer.stats.settle()  # the step synchronised: its copy waits can be read
    weights = runner.weight_receipt()
    device_peak = reading.peak_bytes
    if device.type != "cuda":  # the tracker counts what the step creates: add what the device holds
        device_peak += (weights["resident_frozen_bytes"] + sum(p.numel() * p.element_size() for _, p in ctx.named_params)
                        + held_state)
    return StepRecord(step + 1, check.loss, lr, seconds, reading.peak_bytes, stats.checkpoint_calls,
                      stats.recomputed_blocks, stats.recomputed_ffn,
                      off.stats.tensors if off else 0, off.stats.bytes if off else 0,
                      off.pool.pool_bytes if off else 0, len(off.pool.keys) if off else 0,
                      reading.baseline_bytes, skipped, **weights, device_peak_bytes=device_peak,
                      **_attention_counts(runner),
                      compiled_graphs=compiled_graphs() - ctx.compiled.graphs if ctx.compiled else 0,
                      grad_norm=check.grad_norm, clipped=clipped(config.optimizer.max_grad_norm, check.grad_norm),
                      dropped_captions=dropped_captions, noise_levels=torch.cat(levels).tolist(),
                      sample_losses=errors.tolist())


def _reset_stats(runner) -> None:
    """Zero the runner's per-step counters (checkpointing, attention saving, offload, streaming)."""
    runner.stats.reset()
    for part in (runner.saving, runner.offloader, runner.streamer):
        if part:
            part.stats.reset()


def _update(ctx: StepContext, check, step: int) -> str | None:
    """The optimizer update after the finiteness ``check``: applied, skipped (the reason returned) or,
    with ``on_nonfinite=stop``, refused; then the loss scale updated and the gradients released.

    Raises:
        TrainingDiverged: a non-finite loss or gradient with ``on_nonfinite=stop``.
    """
    skipped = None
    if check.ok or (ctx.scaler.is_enabled() and check.loss_finite):
        ctx.updating = True  # from here an out-of-memory error leaves the LoRA half-updated
        ctx.scaler.step(ctx.optimizer)  # with loss scaling an overflow is skipped here, the scale lowered
        ctx.updating = False
        if not check.ok:
            skipped = f"fp16 loss-scale overflow in {check.bad_module}; scale lowered"
    elif ctx.config.guards.on_nonfinite == "stop":
        raise TrainingDiverged(describe(check, step + 1, ctx.guard_context()))
    else:
        skipped = describe(check, step + 1, ctx.guard_context())
    if ctx.scaler.is_enabled():
        ctx.scaler.update()
    ctx.optimizer.zero_grad(set_to_none=True)  # release gradients before the next forward
    return skipped


def _sample_errors(prediction: torch.Tensor, target: torch.Tensor, batch: int, rows: slice | None,
                   share: float = 1.0) -> torch.Tensor:
    """Each sample's unweighted mean squared error, ``(batch,)`` fp32 (``loss_by_noise_level``): a
    multi-process run's ``rows`` hold this rank's, the other rows 0 (summed over ranks at the end of
    the step); a rank that trained a row with loss factor ``share`` 0 (none of its own) adds none."""
    error = per_sample_mse(prediction.detach(), target)
    if rows is None:
        return error
    full = torch.zeros(batch, device=error.device)
    if share:
        full[rows] = error
    return full


def _text(cache: dict[str, torch.Tensor], index: list[int], dropped: torch.Tensor,
          empty: TextBatch | None) -> TextBatch:
    """The conditioning of cache rows ``index``: each row's caption, or where ``dropped`` (``(B,)``
    bool) the empty caption's (``empty``, ``(1, L, D)``: ``caption_dropout``)."""
    text = TextBatch(cache["text_seq"][index], cache["text_mask"][index],
                     cache["text_pooled"][index] if "text_pooled" in cache else None)
    if not bool(dropped.any()):
        return text
    if empty is None:  # the run's checks refuse caption_dropout where no empty caption is encoded
        raise ValueError("caption_dropout: no empty caption's conditioning was encoded for this run")

    def pick(rows: torch.Tensor, blank: torch.Tensor) -> torch.Tensor:
        return torch.where(dropped.view(-1, *[1] * (rows.ndim - 1)), blank.to(rows.dtype), rows)

    return TextBatch(pick(text.seq, empty.seq), pick(text.mask, empty.mask),
                     None if text.pooled is None else pick(text.pooled, empty.pooled))


def _attention_counts(runner: SegmentRunner) -> dict[str, int]:
    """The step's attention-saving counts; warns once per run where a region saved nothing (the
    math SDPA path is decomposed before the policy sees it: no saving is claimed there)."""
    saving = runner.saving
    if saving is None:
        return {}
    stats = saving.stats
    if stats.unsaved_regions and not saving.warned:
        saving.warned = True
        warnings.warn(f"gradient_checkpointing_save_attention: {stats.unsaved_regions} checkpointed regions ran no "
                      "fused attention kernel (the math SDPA path, e.g. attention_backend=math or a mask the fused "
                      "kernels refuse): nothing was saved there, they recompute attention", ScheduleWarning,
                      stacklevel=4)
    return {"saved_attention_outputs": stats.saved_outputs, "saved_attention_bytes": stats.saved_bytes,
            "recomputed_attention_calls": stats.recomputed_calls, "unsaved_attention_regions": stats.unsaved_regions}


def _draw(ctx: StepContext) -> tuple[list[int], torch.Tensor]:
    """The next micro-batch: its cache rows and latents ``(B, C, ...)`` (random windows drawn)."""
    positions = ctx.sampler.next_batch()
    rows = [ctx.epoch[i] for i in positions]
    latents = latents_for(ctx.cache, rows)
    if ctx.random_windows is not None:
        latents = ctx.random_windows.latents(latents, rows, positions, ctx.sampler.epoch)
    return rows, latents


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (an 8-bit state's inner tensors: its codes and scales)."""
    return sum(tensor_bytes(t) for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


def _recompute_message(ctx: StepContext, mismatch: RecomputeMismatch, step: int) -> str:
    """One line: where the recompute differed, why that happens, and which schedules avoid it."""
    start, end = mismatch.blocks
    region = f"block {start}" if end - start == 1 else f"blocks {start}-{end - 1} (last entered: {mismatch.block})"
    what = f"the FFN of block {mismatch.block}" if mismatch.ffn else region
    block_list = next((bl for bl in ctx.family.block_lists if bl.name == mismatch.list_name), None)
    ffn_only = (" torch-ffn (only the FFN is recomputed) if the block's attention is what branches;"
                if block_list is not None and block_list.ffn and not mismatch.ffn else "")
    return (f"step {step}: the recompute of {ctx.family.name} block list {mismatch.list_name!r}, {what}, was not "
            f"deterministic ({mismatch}): its forward took another path when run again in backward (it depends "
            f"on free memory, a global flag or a cache). Schedules that do not recompute it: "
            f"gradient_checkpointing false;{ffn_only} or an interval and stride that leave block {mismatch.block} "
            f"plain (blocks [k*S, k*S+N) are recomputed). The last good step is saved.")
