"""The planner's time calibration: what the engine's machinery costs per tensor on this machine.

A probe (:mod:`.probe`) measures each block's forward seconds and counts the tensors it saves for
backward. What a schedule adds to the plain step is then mostly per-tensor bookkeeping in Python
saved-tensor hooks, not arithmetic: at the sizes where a schedule matters on the CPU, a checkpointed
block costs its forward again plus ``torch.utils.checkpoint``'s two hook calls per saved tensor,
an offloaded tensor its pack, copy and unpack, and a streamed block its streamer's hook per saved
tensor besides the weight copies. :func:`calibrate` measures those three rates once: short runs of
the plain step, the plain step with attention offload, every block checkpointed (``layer``) and,
when streaming is in play, every block streamed, timed in lockstep (:mod:`.lockstep`: one step of
each in turn, so a shared machine's drift cancels), each run's median extra seconds over the
plain one divided by what it adds (docs/SCHEDULES.md "How the planner predicts").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..config.schedule import CheckpointSchedule
from .lockstep import lockstep_runs, paired_difference
from .runs import RunWorkspace

CALIBRATION_STEPS = 3
"""Measured steps of each calibration run after its warm-up."""
PLAIN = CheckpointSchedule(gradient_checkpointing=False)
"""The reference run of the calibration (and the probe's own schedule)."""


@dataclass(frozen=True)
class Calibration:
    """Per-tensor costs of the engine's machinery, seconds (0 where nothing was measured).

    Attributes:
        offload_s_per_tensor / offload_s_per_byte: one tensor kept in host memory by the offloader
            (pack, device-to-host copy, unpack, copy back); the byte rate is a measured memcpy.
        recompute_s_per_tensor: a checkpointed block's bookkeeping per tensor it saves (on top of
            its forward seconds, which the recompute spends again).
        stream_s_per_tensor: a streamed block's bookkeeping per tensor it saves (the streamer's
            pack hook; the weight copies are counted apart, per byte).
    """

    offload_s_per_tensor: float = 0.0
    offload_s_per_byte: float = 0.0
    recompute_s_per_tensor: float = 0.0
    stream_s_per_tensor: float = 0.0


@dataclass(frozen=True)
class Counts:
    """What the calibration runs add to the plain step, from the probe's recorded step.

    Attributes:
        attn_tensors / attn_bytes: tensors and bytes attention offload copies per step (routed
            attention only; 0: the family has none, no offload run).
        forward_s: every block's forward seconds. saved_tensors: every block's saved tensors.
        frozen_bytes: every block's frozen weight bytes (0: no streaming run).
    """

    attn_tensors: int
    attn_bytes: int
    forward_s: float
    saved_tensors: int
    frozen_bytes: int


def calibration_runs(attention: bool, stream: bool) -> int:
    """How many runs :func:`calibrate` trains: the plain one, ``layer``, and attention offload
    and streaming where they apply."""
    return 2 + attention + stream


def calibration_steps(warmup_steps: int, attention: bool = True, stream: bool = False) -> int:
    """Steps :func:`calibrate` trains in all, what a caller announces before probing."""
    return calibration_runs(attention, stream) * (warmup_steps + CALIBRATION_STEPS)


def calibrate(config: TrainConfig, bundle, warmup_steps: int, workspace: RunWorkspace, counts: Counts,
              h2d_s_per_byte: float) -> Calibration:
    """Measure the :class:`Calibration` of this machine (see the module docstring).

    Args:
        config / bundle / workspace: the probe's (each run trains its own copy of the model).
        warmup_steps: unpaired leading steps of each run.
        counts: what each run adds, from the probe.
        h2d_s_per_byte: seconds per byte of one weight copy (the streaming run copies every block
            twice: forward, backward).

    Raises:
        Exception: the first error of a calibration run (as :func:`~.lockstep.lockstep_runs`).
    """
    schedules = [PLAIN, CheckpointSchedule()]
    if counts.attn_tensors:
        schedules.append(PLAIN.replace(gradient_checkpointing_offload_attention=True))
    if counts.frozen_bytes:
        schedules.append(PLAIN.replace(weight_offload="stream"))
    results = dict(zip((s.mode for s in schedules),
                       lockstep_runs(config, bundle, schedules, warmup_steps, CALIBRATION_STEPS, workspace=workspace)))
    plain = results.pop(PLAIN.mode)

    def extra(mode: str) -> float:
        return max(0.0, paired_difference(results[mode], plain, warmup_steps)) if mode in results else 0.0

    per_tensor = lambda seconds, tensors: max(0.0, seconds) / tensors if tensors else 0.0  # noqa: E731
    device = torch.device(plain.report["environment"]["device"])
    per_byte = copy_seconds_per_byte(device) if counts.attn_tensors else 0.0
    return Calibration(
        offload_s_per_tensor=per_tensor(extra("none-offload-attn") - per_byte * counts.attn_bytes, counts.attn_tensors),
        offload_s_per_byte=per_byte,
        recompute_s_per_tensor=per_tensor(extra("layer") - counts.forward_s, counts.saved_tensors),
        stream_s_per_tensor=per_tensor(extra("none-stream") - 2 * counts.frozen_bytes * h2d_s_per_byte,
                                       counts.saved_tensors))


def copy_seconds_per_byte(device: torch.device) -> float:
    """Seconds per byte of one device -> host -> device round trip (16 MiB, best of 3)."""
    source = torch.empty(4 << 20, dtype=torch.float32, device=device)
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        source.copy_(target)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best / source.nbytes
