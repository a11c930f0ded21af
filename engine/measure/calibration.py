"""The planner's time calibration: what the engine's machinery costs on this machine.

A probe (:mod:`.probe`) measures each block's forward seconds and counts the tensors it saves for
backward. What a schedule adds to the plain step (:class:`~.costs.Work`) is then the recomputed
forward seconds plus bookkeeping that does not scale with the arithmetic: a checkpoint call's own
cost, ``torch.utils.checkpoint``'s hook calls per tensor a recomputed region saves, an offloaded
tensor's pack, copy and unpack, a streamed plain block's hook per tensor it saves (its weight
copies are priced per byte). At the sizes where a schedule matters on the CPU that bookkeeping is
a large share of the cost. :func:`calibrate` measures its rates once: short runs of the plain step,
every block checkpointed (``layer``), every FFN checkpointed (``layer-torch-ffn``: the per-call and
per-tensor rates are solved from the two), attention offload and, when the config streams weights,
every block streamed, timed in lockstep (:mod:`.lockstep`: one step of each in turn, so a shared
machine's drift cancels); each rate is a run's median extra seconds over the plain one, less what
the other rates explain, divided by what it adds (docs/MEASURE.md "How the planner predicts").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..config.schedule import CheckpointSchedule
from ..families import get_family
from .costs import BlockCost, Work, work
from .lockstep import lockstep_runs, paired_difference
from .runs import RunWorkspace

CALIBRATION_STEPS = 3
"""Measured steps of each calibration run after its warm-up."""
PLAIN = CheckpointSchedule(gradient_checkpointing=False)
"""The reference run of the calibration (and the probe's own schedule)."""


@dataclass(frozen=True)
class Calibration:
    """Costs of the engine's machinery, seconds (0 where nothing was measured).

    Attributes:
        offload_s_per_tensor / offload_s_per_byte: one tensor kept in host memory by the offloader
            (pack, device-to-host copy, unpack, copy back); the byte rate is a measured memcpy.
        recompute_s_per_call / recompute_s_per_tensor: a checkpoint call's own bookkeeping, and
            its hooks' per tensor the region saves (on top of the region's forward seconds, which
            the recompute spends again).
        stream_s_per_tensor: the streamer's pack hook per tensor a streamed plain block saves (the
            weight copies are counted apart, per byte).
    """

    offload_s_per_tensor: float = 0.0
    offload_s_per_byte: float = 0.0
    recompute_s_per_call: float = 0.0
    recompute_s_per_tensor: float = 0.0
    stream_s_per_tensor: float = 0.0


def seconds(calibration: Calibration, added: Work) -> float:
    """Seconds ``added`` costs on top of the plain step at ``calibration``'s rates (weight copies apart)."""
    return (added.recompute_s + added.calls * calibration.recompute_s_per_call
            + added.recompute_tensors * calibration.recompute_s_per_tensor
            + added.offload_tensors * calibration.offload_s_per_tensor
            + added.offload_bytes * calibration.offload_s_per_byte
            + added.stream_tensors * calibration.stream_s_per_tensor)


CALIBRATION_RUNS = 4
"""The runs :func:`calibrate` trains without streaming (plain, layer, FFN, attention offload): what
a caller announces before probing; the probe corrects it by the runs it adds (streaming) or leaves
out (no FFN sub-blocks, no attention to offload)."""


def calibration_steps(warmup_steps: int, runs: int = CALIBRATION_RUNS) -> int:
    """Steps of ``runs`` calibration runs."""
    return runs * (warmup_steps + CALIBRATION_STEPS)


def calibration_schedules(family, blocks: dict[str, list[BlockCost]], stream: bool) -> list[CheckpointSchedule]:
    """The runs of :func:`calibrate` after the plain one: ``layer``, and where they add work,
    ``layer-torch-ffn`` (a family with FFN sub-blocks), attention offload, every block streamed
    (``stream``: the config streams weights)."""
    candidates = [CheckpointSchedule(), CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"),
                  PLAIN.replace(gradient_checkpointing_offload_attention=True)]
    if stream:
        candidates.append(PLAIN.replace(weight_offload="stream"))
    useful = []
    for schedule in candidates:
        added = work(family, blocks, schedule).work
        if added.calls or added.offload_tensors or added.stream_tensors:
            useful.append(schedule)
    return useful


def calibrate(config: TrainConfig, bundle, warmup_steps: int, workspace: RunWorkspace,
              schedules: list[CheckpointSchedule], blocks: dict[str, list[BlockCost]], frozen_bytes: int,
              h2d_s_per_byte: float) -> Calibration:
    """Measure the :class:`Calibration` of this machine (see the module docstring).

    Args:
        config / bundle / workspace: the probe's (each run trains its own copy of the model).
        warmup_steps: unpaired leading steps of each run.
        schedules: the runs besides the plain one (:func:`calibration_schedules`).
        blocks: the probe's block costs (what each run adds, :func:`~.costs.work`).
        frozen_bytes: every block's frozen bytes (the streaming run copies each twice).
        h2d_s_per_byte: seconds per byte of one weight copy.

    Raises:
        Exception: the first error of a calibration run (as :func:`~.lockstep.lockstep_runs`).
    """
    family = get_family(bundle.family.name)
    results = lockstep_runs(config, bundle, [PLAIN, *schedules], warmup_steps, CALIBRATION_STEPS, workspace=workspace)
    plain, extra = results[0], {}
    for schedule, result in zip(schedules, results[1:]):
        extra[schedule.mode] = (max(0.0, paired_difference(result, plain, warmup_steps)),
                                work(family, blocks, schedule).work)
    per_byte = copy_seconds_per_byte(torch.device(plain.report["environment"]["device"]))
    per_call, per_tensor = _recompute_rates(extra.get("layer"), extra.get("layer-torch-ffn"))
    offload, stream = extra.get("none-offload-attn"), extra.get("none-stream")
    return Calibration(
        offload_s_per_tensor=_rate(offload[0] - per_byte * offload[1].offload_bytes, offload[1].offload_tensors)
        if offload else 0.0,
        offload_s_per_byte=per_byte, recompute_s_per_call=per_call, recompute_s_per_tensor=per_tensor,
        stream_s_per_tensor=_rate(stream[0] - 2 * frozen_bytes * h2d_s_per_byte, stream[1].stream_tensors)
        if stream else 0.0)


def _rate(extra_s: float, count: int) -> float:
    return max(0.0, extra_s) / count if count else 0.0


def _recompute_rates(layer: tuple[float, Work] | None, ffn: tuple[float, Work] | None) -> tuple[float, float]:
    """(seconds per checkpoint call, seconds per saved tensor) from two runs: every block
    checkpointed (many tensors per call) and every FFN (few): the two equations
    ``extra - recompute_s = calls * per_call + tensors * per_tensor``, solved; without the FFN
    run, or where a solved rate is negative (noise), one rate per tensor."""
    if layer is None:
        return 0.0, 0.0
    extra_a, a = layer
    left_a = max(0.0, extra_a - a.recompute_s)
    if ffn is not None:
        extra_b, b = ffn
        left_b = max(0.0, extra_b - b.recompute_s)
        det = a.calls * b.recompute_tensors - b.calls * a.recompute_tensors
        if det:
            per_call = (left_a * b.recompute_tensors - left_b * a.recompute_tensors) / det
            per_tensor = (a.calls * left_b - b.calls * left_a) / det
            if per_call >= 0 and per_tensor >= 0:
                return per_call, per_tensor
    return 0.0, _rate(left_a, a.recompute_tensors)


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
