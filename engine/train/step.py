"""One optimizer step of a training run, read top to bottom, and the learning-rate schedule.

A step: set the learning rate -> for each micro-batch: noise the cached latents, the captions'
conditioning (some replaced by the empty caption's, ``caption_dropout``), forward (under autocast
and the run's SDPA kernels), loss, backward (checkpointed regions recompute here, and offloaded
inputs come back) -> fp16 unscaling, the gradients' norm and clipping (``max_grad_norm``) -> the
non-finite guard (one synchronisation, which also reads the norm) -> the optimizer step (or a
skip) -> gradients released.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

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
from .records import StepCheckpointing, StepCompile, StepMemory, StepRecord, StepSaving, StepStreaming, StepTiming


class RecomputeNotRepeatable(TrainingStopped):
    """A checkpointed region computed something else in its recompute than in its forward."""


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
    optim, device = ctx.config.optimizer, ctx.device
    lr = optim.learning_rate * ctx.lr_factor(step)
    set_learning_rate(ctx.optimizer, lr)
    _reset_stats(ctx.runner)
    # optimizer state that exists before the step is held on the device (the CPU tracker misses it)
    held_state = _state_bytes(ctx.optimizer) if device.type != "cuda" else 0
    # the micro-batches' rows and latents (random clip windows are decoded and encoded here, unmeasured)
    batches = [_draw(ctx) for _ in range(optim.gradient_accumulation_steps)]
    with ctx.memory.measure() as reading, ctx.timer.step():
        started = time.perf_counter()
        loss_sum, passes = torch.zeros((), device=device), []
        # one SDPA kernel choice for forward, backward and every recompute inside backward
        with sdpa_context(ctx.kernels):
            for micro, (index, latents) in enumerate(batches):
                # ddp: the last micro-batch's backward averages the accumulated gradients over ranks
                with sync_gradients(ctx.runner.entry, micro + 1 == len(batches)):
                    loss, done = _micro_batch(ctx, step, micro, index, latents)
                loss_sum += loss
                passes.append(done)
        ctx.scaler.unscale_(ctx.optimizer)  # fp16 loss scaling only; a no-op otherwise
        # the norm before clipping (sharded: the whole model's); gradients scaled to max_grad_norm
        grad_norm = clip_gradients([p for _, p in ctx.named_params], optim.max_grad_norm)
        errors = torch.cat([p.errors for p in passes])
        if ctx.dist is not None:  # the global batch's loss; every rank judges the gradients alike
            loss_sum = ctx.dist.mean(loss_sum)
            errors = ctx.dist.mean(errors) * ctx.dist.world_size  # each row's error is on one rank only
        check = check_finite(loss_sum, ctx.named_params, ctx.dist.all_true if ctx.dist is not None else None,
                             grad_norm)  # the step's one synchronisation
        skipped = _update(ctx, check, step)
        seconds = time.perf_counter() - started
    return StepRecord(step + 1, check.loss, lr, check.grad_norm, clipped(optim.max_grad_norm, check.grad_norm),
                      skipped, sum(p.dropped for p in passes), torch.cat([p.levels for p in passes]).tolist(),
                      errors.tolist(), timing=StepTiming(seconds), **_measurements(ctx, reading, held_state))


@dataclass
class _Pass:
    """What one micro-batch's pass leaves for its step's record.

    Attributes:
        dropped: its samples that trained with the empty caption. levels: each sample's noise
            level, ``(B,)`` (the global batch's). errors: each sample's unweighted error, ``(B,)``.
    """

    dropped: int
    levels: torch.Tensor
    errors: torch.Tensor


def _micro_batch(ctx: StepContext, step: int, micro: int, index: list[int],
                 latents: torch.Tensor) -> tuple[torch.Tensor, _Pass]:
    """Forward and backward of one micro-batch (cache rows ``index``, latents ``(B, C, ...)``): its
    loss (detached, scaled to its share of the step) and what the record keeps of it.

    Raises:
        RecomputeNotRepeatable: a checkpointed region took another path in its recompute.
    """
    config, family, model, device = ctx.config, ctx.family, ctx.model, ctx.device
    noisy, sigmas, target = ctx.noise.noisy_latents(latents, ctx.noise_gen, family.shared_sigma)
    dropped = caption_dropout(config.seed, step, micro, len(index), config.data.caption_dropout)
    done = _Pass(int(dropped.sum()), sigmas, torch.empty(0))
    rows, share = None, 1.0
    if ctx.dist is not None:  # every rank drew the global batch and its noise; it trains its rows
        rows, share = ctx.dist.share(len(index))
        index, noisy, sigmas, target, dropped = index[rows], noisy[rows], sigmas[rows], target[rows], dropped[rows]
    text = _text(ctx.cache, index, dropped, ctx.empty_text).to(device)
    noisy, sigmas, target = noisy.to(device), sigmas.to(device), target.to(device)
    ctx.batch_shape = tuple(noisy.shape)
    with ctx.precision.autocast(device):
        output = ctx.runner.forward(**guided_inputs(family, model, noisy, sigmas, text, config.objective.guidance_value))
        prediction = family.read_output(model, output, noisy)
    loss = ctx.noise.loss(prediction, target, sigmas) * share / config.optimizer.gradient_accumulation_steps
    # checkpointed regions are recomputed (offloaded inputs copied back) in here
    try:
        ctx.scaler.scale(loss).backward()
    except CheckpointError as exc:
        raise RecomputeNotRepeatable(_recompute_message(ctx, ctx.runner.recompute_mismatch(exc), step + 1)) from exc
    # each sample's unweighted error (after backward: its temporary adds nothing to the peak)
    done.errors = _sample_errors(prediction, target, len(done.levels), rows, share)
    return loss.detach(), done


def _measurements(ctx: StepContext, reading: Any, held_state: int) -> dict[str, Any]:
    """The record's measurement groups but timing, read after the step (``reading``: its
    :class:`~..core.memory.PeakMemory` reading; ``held_state``: the optimizer state's bytes
    before it, counted on the CPU)."""
    runner = ctx.runner
    stats, off = runner.stats, runner.offloader
    if runner.streamer:
        runner.streamer.stats.settle()  # the step synchronised: its copy waits can be read
    streaming = StepStreaming(**runner.weight_receipt())
    device_peak = reading.peak_bytes
    if ctx.device.type != "cuda":  # the tracker counts what the step creates: add what the device holds
        device_peak += (streaming.resident_frozen_bytes + held_state
                        + sum(p.numel() * p.element_size() for _, p in ctx.named_params))
    return {"memory": StepMemory(reading.peak_bytes, reading.baseline_bytes, device_peak),
            "checkpointing": StepCheckpointing(
                stats.checkpoint_calls, stats.recomputed_blocks, stats.recomputed_ffn,
                off.stats.tensors if off else 0, off.stats.bytes if off else 0,
                off.pool.pool_bytes if off else 0, len(off.pool.keys) if off else 0),
            "streaming": streaming, "saving": _attention_counts(runner),
            "compile": StepCompile(compiled_graphs() - ctx.compiled.graphs if ctx.compiled else 0)}


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


def _attention_counts(runner: SegmentRunner) -> StepSaving:
    """The step's attention-saving counts; warns once per run where a region saved nothing (the
    math SDPA path is decomposed before the policy sees it: no saving is claimed there)."""
    saving = runner.saving
    if saving is None:
        return StepSaving()
    stats = saving.stats
    if stats.unsaved_regions and not saving.warned:
        saving.warned = True
        warnings.warn(f"gradient_checkpointing_save_attention: {stats.unsaved_regions} checkpointed regions ran no "
                      "fused attention kernel (the math SDPA path, e.g. attention_backend=math or a mask the fused "
                      "kernels refuse): nothing was saved there, they recompute attention", ScheduleWarning,
                      stacklevel=5)
    return StepSaving(stats.saved_outputs, stats.saved_bytes, stats.recomputed_calls, stats.unsaved_regions)


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


@contextlib.contextmanager
def work_context(writer: bool) -> Iterator[None]:
    """A run's own state, entered for each piece of its work and left before every ``yield`` of the
    run's iterator (runs interleaved in one thread cannot see each other's); ``writer``: this
    process writes (the other ranks' warnings are silenced: rank 0 says it once)."""
    # Autograd must be on even when the caller runs under torch.inference_mode() (ComfyUI does).
    with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
        if not writer:
            warnings.simplefilter("ignore")
        # FSDP2 warns for every block returning a view, in case the caller changes it in place
        # (dropping the block's pre-backward hook); diffusers' loops do not, and
        # tests/model/test_distributed.py checks that sharded gradients equal single-process ones
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        # torch's layer/RMS norms warn that bf16 input meets fp32 weights (autocast keeps
        # norms in fp32 by design); that is expected here, not a fault of the run
        warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight")
        yield
