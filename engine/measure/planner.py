"""Schedule planner: pick the fastest checkpointing schedule that fits a memory budget.

One probe run (:func:`~.probe.probe`: no checkpointing, a :class:`~..train.loop.TrainingRun`, so the
numbers are measured exactly like a sweep cell) measures, per block of every block list:

* ``act``: bytes of the tensors the block saves for backward (its activations), deduplicated by
  storage, parameters and tensors shared by every block (time embedding, rotary tables) left out;
* ``carried``: bytes of its carried inputs (what a checkpoint region starting there keeps);
* ``ffn`` / ``ffn_in`` / ``attn``: the part saved inside its FFN sub-module, the FFN's input
  when nothing outside the FFN saves it (a checkpoint of the FFN keeps it; with frozen weights a
  plain FFN may not), and the part saved inside its attention sub-module;
* ``fwd_s`` / ``ffn_s``: forward seconds of the block and of its FFN;
* ``ffn_in_attn``: the part of the FFN's input that the attention saves too (attention offload
  cannot free it while a ``torch-ffn`` checkpoint keeps it);
* ``grad``: bytes of the block's trainable (LoRA) parameters, i.e. of the gradients its backward
  adds and which stay until the optimizer step;
* ``fwd_peak``: the highest memory above the block's start reached during its forward (its saved
  activations plus transient tensors such as attention scores), from the CPU live-tensor tracker
  (0 on CUDA, where the allocator's peak cannot be read per block without losing the step's).

plus the step's peak and sec/step (when the plain step does not fit the device, measured on a copy
with two blocks per list and extrapolated: :func:`~.probe.shallow_probe`). ``base`` = probe peak -
all blocks' ``act`` is what the step holds besides block activations, the weights included (a
schedule that streams subtracts the streamed blocks' frozen bytes and adds its device ring). For a candidate schedule the model then predicts (see
:func:`predict`):

* what each block keeps until backward: ``act`` when plain (minus ``attn`` with attention
  offload); a whole-block segment keeps only its first block's ``carried`` inputs (nothing with
  ``unsloth``: they wait in host memory); an FFN-checkpointed block keeps ``act - ffn +
  ffn_in`` (``- ffn_in`` more with ``unsloth-ffn``);
* the peak = the larger of ``base`` + the largest of: everything kept at the end of forward, or,
  for each block / segment in backward order, what the blocks before it keep plus its own full
  activations (a segment is recomputed whole, so its interior is alive at once) plus the
  gradients of the blocks after it; and the forward base + for each segment's recompute, the
  blocks before it, its interior's activations and its last block's ``fwd_peak``;
* sec/step = the probe's sec/step + what the schedule adds (:class:`~.costs.Work`: recomputed
  forward seconds, checkpoint calls and the tensors their hooks see, offloaded tensors and bytes,
  streamed weight copies and the tensors the streamer's hook sees) at the rates
  :func:`~.costs.calibrate` measured on this machine (docs/MEASURE.md "How the planner predicts").

The planner returns the fastest predicted schedule whose predicted peak fits; predictions within
``TIE`` of each other follow the documents' decision rule (docs/SCHEDULES.md "How to decide"): no
checkpointing, then ``torch-ffn``, ``torch``, ``unsloth-ffn``, ``unsloth``; plain over offload;
the larger interval and stride. The time model is only as good as its calibration: on a shared
CPU, step times drift by tens of percent and schedules predicted a few percent apart can be 15%
apart in fact. So when asked to measure, :func:`~.planning.plan_for_budget` times the chosen prediction and the
fastest fitting ones had the calibrated offloader cost been half or twice as large (see
:func:`contenders`) head to head in lockstep, and keeps the fastest measured one that fits
(measured ties again follow the documents' rule).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.schedule import MAX_BLOCKS, CheckpointSchedule, ScheduleError, check_supported
from ..core.arena import planned_total
from ..core.memory import budget_bytes
from ..core.plan import effective_plan
from ..families import get_family
from ..files.atomic import atomic_write_text
from .costs import seconds, work
from .probe import Probe
from .sweep import sweep_schedules

TIE = 0.03
"""Relative sec/step difference under which two predictions count as equal."""


class PlannerError(ValueError):
    """The budget is invalid, or no candidate schedule is predicted to fit it.

    Attributes:
        probe / smallest: when no candidate fits the device, the probe and the prediction with the
            smallest peak (:func:`~.ranks.sharded_choice` plans FSDP2 from them), else None.
    """

    def __init__(self, message: str, probe: Probe | None = None, smallest: "Prediction | None" = None):
        super().__init__(message)
        self.probe, self.smallest = probe, smallest


@dataclass
class Prediction:
    """Predicted peak (bytes) and sec/step of one candidate schedule, and, for the candidates the
    planner timed head to head, what they measured.

    Attributes:
        offloaded_tensors: tensors per step the plan copies to host memory (0: the offloader
            has nothing to do, e.g. attention offload when every block is checkpointed).
        host_bytes: host memory it needs: streamed weights' host copies as allocated (their chunks) plus offloaded activations.
        streamed_bytes: frozen bytes it streams; weight_h2d_bytes: its weight copies per step.
        measured_sec_per_step: median seconds per step after warm-up (lockstep run), or None.
        measured_peak_bytes: largest peak of the steps after warm-up, or None.
        relative_time: median of its step times over the fastest-predicted contender's,
            step by step (:func:`~.lockstep.paired_ratio`; 1.0 for that one), or None.
    """

    schedule: CheckpointSchedule
    peak_bytes: int
    sec_per_step: float
    fits: bool = False
    offloaded_tensors: int = 0
    host_bytes: int = 0
    streamed_bytes: int = 0
    weight_h2d_bytes: int = 0
    measured_sec_per_step: float | None = None
    measured_peak_bytes: int | None = None
    relative_time: float | None = None


@dataclass
class PlanChoice:
    """The planner's answer.

    Attributes:
        budget_bytes: the budget. chosen: the prediction picked. candidates: every prediction.
        measured_sec_per_step / measured_peak_bytes: the chosen schedule run for real (when
            :func:`~.planning.plan_for_budget` was asked to measure), else ``None``.
    """

    budget_bytes: int
    chosen: Prediction
    candidates: list[Prediction]
    probe: Probe
    measured_sec_per_step: float | None = None
    measured_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    host_budget_bytes: int | None = None
    by_frames: dict[int, "PlanChoice"] = field(default_factory=dict)
    """``plan --frames``: per pixel-frame count, the choice predicted at that count (``chosen`` is
    the largest count's, measured when asked, predicted to fit every count)."""
    labels: dict[int, str] = field(default_factory=dict)
    """Per frame count: what it trains on (``5 frames (2 latent frames, 128 tokens per sample)``)."""
    compile_blocks: bool | None = None
    """The ``compile`` lever's decision (:func:`~.planning.try_levers`): True when ``compile_blocks``
    measured faster within the budget, False when it did not; None when it was not tried (the
    run's own value stands)."""
    ranks: Any = None
    """``plan --nproc N`` (N >= 2): per-rank peaks under DDP and FSDP2 and which to run
    (:class:`~.ranks.RankPeaks`), else None."""
    verdict: Any = None
    """With buckets or clips (several batch shapes): the pre-flight of the chosen schedule per shape
    (:class:`~.preflight.Verdict`, ``engine/measure/planning.py``), else None."""

    def options(self) -> dict[str, Any]:
        """The plan as a set of option changes, by flat key (what ``schedule.json`` holds and
        ``segckpt train --config`` reads): the chosen schedule's keys (checkpointing, attention
        offload and saving, weight streaming) and, when a lever decided it, ``compile_blocks``."""
        keys = self.chosen.schedule.to_dict()
        return keys if self.compile_blocks is None else {**keys, "compile_blocks": self.compile_blocks}

    def render(self) -> str:
        """A table of the candidates (predicted, and where timed measured, sec/step / peak GiB),
        the chosen one marked; with frame counts one table per count, then the predicted peak of
        the chosen schedule at each count; then the per-shape :attr:`verdict`; with :attr:`ranks`,
        its line last."""
        text = self._tables()
        text = text if self.verdict is None else f"{text}\n{self.verdict.render()}"
        return text if self.ranks is None else f"{text}\n{self.ranks.render()}"

    def _tables(self) -> str:
        if not self.by_frames:
            return self._table()
        parts = []
        for n, choice in self.by_frames.items():
            parts += [f"## {self.labels.get(n, f'{n} frames')}", choice._table(), ""]
        peaks = ", ".join(f"{n} frames {predict(c.probe, self.chosen.schedule).peak_bytes / 2**30:.4g} GiB"
                          for n, c in self.by_frames.items())
        parts.append(f"predicted peak of {self.chosen.schedule.mode} per frame count: {peaks}")
        return "\n".join(parts)

    def _table(self) -> str:
        host = (f", host budget {self.host_budget_bytes / 2**30:.4g} GiB" if self.host_budget_bytes is not None else "")
        lines = [f"budget {self.budget_bytes / 2**30:.4g} GiB{host}; probe: {self.probe.sec_per_step:.3f} sec/step, "
                 f"peak {self.probe.peak_bytes / 2**30:.4g} GiB without checkpointing",
                 f"{'':2}{'mode':<44} {'predicted sec/step / peak GiB':>30}   {'measured (x the predicted choice)':>33}",
                 f"{'':2}(-> chosen, x predicted over the budget less {MARGIN:.0%} headroom"
                 + (", or over the host budget" if self.host_budget_bytes is not None else "") + ")"]
        for p in sorted(self.candidates, key=lambda p: p.sec_per_step):
            mark = "->" if p is self.chosen else ("  " if p.fits else " x")
            measured = ""
            if p.measured_sec_per_step is not None:
                measured = (f"   {p.measured_sec_per_step:>9.3f} / {p.measured_peak_bytes / 2**30:.4g}"
                            + (f" (x{p.relative_time:.3f})" if p.relative_time is not None else ""))
            streamed = (f"   host {p.host_bytes / 2**30:.4g} GiB (weights {p.streamed_bytes / 2**30:.4g})"
                        if p.host_bytes else "")
            lines.append(f"{mark}{p.schedule.mode:<44} {p.sec_per_step:>9.3f} / {p.peak_bytes / 2**30:<18.4g}{measured}"
                         f"{streamed}")
        if self.chosen.schedule.streams:  # which blocks stream
            counts = {name: len(costs) for name, costs in self.probe.blocks.items()}
            lines.append(effective_plan(get_family(self.probe.family), self.chosen.schedule, counts, warn=False).render())
        if self.probe.extrapolated_from:
            lines.append(f"probe: the plain step did not fit; measured a copy with {self.probe.extrapolated_from} "
                         "blocks per list, its last block standing for the others")
        if self.measured_sec_per_step is not None:
            lines.append(f"measured {self.chosen.schedule.mode}: {self.measured_sec_per_step:.3f} sec/step / "
                         f"{self.measured_peak_bytes / 2**30:.4g} GiB")
        lines.extend(self.notes)
        return "\n".join(lines)


def predict(probe_: Probe, schedule: CheckpointSchedule) -> Prediction:
    """Predicted peak bytes and sec/step of ``schedule`` (see the module docstring).

    Raises:
        ScheduleError: the family cannot run ``schedule``.
    """
    walk = work(get_family(probe_.family), probe_.blocks, schedule)
    peak = max(probe_.base_bytes + max(walk.worst, walk.kept_before), probe_.forward_base_bytes + walk.forward_worst)
    prediction = Prediction(schedule, int(peak), probe_.sec_per_step + seconds(probe_.calibration, walk.work),
                            offloaded_tensors=walk.work.offload_tensors, host_bytes=walk.kept_on_host)
    return _with_streaming(probe_, walk.plan, prediction) if walk.plan.streamed_blocks else prediction


def _with_streaming(probe_: Probe, plan, prediction: Prediction) -> Prediction:
    """Weight streaming's share of a prediction (docs/STREAMING.md "What it costs"): the streamed
    blocks' frozen bytes leave the device peak (and join host memory as the chunks that hold them,
    :func:`~..core.arena.planned_total`) and a ring of ``prefetch + 1`` of the largest unit
    joins it; each unit is copied in forward and again in backward. On CUDA a copy ahead overlaps
    the compute of the unit before it (forward) or after it (backward, about twice the forward
    time): only what it does not cover is added; on the CPU (or with prefetch 0) copies run inline."""
    schedule = plan.schedule
    names = [lp.name for lp in plan.lists]
    frozen = probe_.frozen_block_bytes
    units = plan.stream_units()
    size = [sum(frozen[names[li]][bi] for li, bi in unit) for unit in units]
    compute = [sum(probe_.blocks[names[li]][bi].fwd_s for li, bi in unit) for unit in units]
    streamed = sum(size)
    ring = max(size) * min(schedule.weight_offload_prefetch + 1, len(size))
    copy = [b * probe_.h2d_s_per_byte for b in size]
    if probe_.device == "cuda" and schedule.weight_offload_prefetch > 0:
        exposed = sum(max(0.0, c - (compute[k - 1] if k else 0.0)) for k, c in enumerate(copy))
        exposed += sum(max(0.0, c - (2 * compute[k + 1] if k + 1 < len(copy) else 0.0)) for k, c in enumerate(copy))
    else:
        exposed = 2 * sum(copy)
    return dataclasses.replace(prediction, peak_bytes=int(prediction.peak_bytes - streamed + ring),
                               sec_per_step=prediction.sec_per_step + exposed,
                               host_bytes=prediction.host_bytes + planned_total(streamed), streamed_bytes=streamed,
                               weight_h2d_bytes=2 * streamed)


def preference(schedule: CheckpointSchedule) -> tuple:
    """The documents' decision rule as a sort key (smaller = preferred on a tie); resident
    weights before streamed ones, fewer streamed blocks before more."""
    streams = (schedule.streams, schedule.weight_offload_blocks or MAX_BLOCKS + 1) if schedule.streams else (False, 0)
    if not schedule.gradient_checkpointing:
        return (0, *streams)
    return (1, *streams, schedule.gradient_checkpointing_offload_attention,
            schedule.backend.preference, -schedule.interval, -schedule.stride)


MARGIN = 0.05
"""Headroom: a candidate fits when its predicted peak is at most ``(1 - MARGIN)`` of the budget."""


def choose(probe_: Probe, budget_bytes: int, candidates: list[CheckpointSchedule] | None = None,
           margin: float = MARGIN, host_budget_bytes: int | None = None, stream: bool = False) -> PlanChoice:
    """The fastest schedule whose predicted peak fits ``budget_bytes`` with ``margin`` headroom,
    and whose host memory (streamed weights, offloaded activations) fits ``host_budget_bytes``.

    Weight streaming is the planner's answer when no candidate (default:
    :func:`~.sweep.sweep_schedules`) fits with its frozen weights on the device: then each is
    tried streaming the fewest blocks that make it fit (:func:`fewest_streamed`), so the fraction
    is chosen, not asked for. (Its copy cost is predicted from a memcpy rate, not measured in
    lockstep like the offloader's, so it does not compete with recompute while weights fit.)
    On a device that is host memory (the CPU) streaming saves nothing, so it is tried there only
    when ``stream`` (the user asked for ``weight_offload=stream``).

    Raises:
        PlannerError: no supported candidate is predicted to fit (the message gives the
            smallest predicted peak, or the host memory the smallest device fit needs, and says
            when streaming was not tried on the CPU).
    """
    family = get_family(probe_.family)
    supported = []
    for schedule in candidates or sweep_schedules():
        try:
            check_supported(family, schedule)
        except ScheduleError:
            continue
        supported.append(schedule)
    limit = budget_bytes * (1 - margin)
    predictions = [predict(probe_, schedule) for schedule in supported]
    if not any(p.peak_bytes <= limit for p in predictions if not p.schedule.streams):
        # nothing fits with the weights on the device: stream the fewest blocks that make each fit
        predictions += [q for p in predictions if not p.schedule.streams
                        for q in fewest_streamed(probe_, p.schedule, limit, stream)]
    for prediction in predictions:
        prediction.fits = prediction.peak_bytes <= limit and (host_budget_bytes is None
                                                             or prediction.host_bytes <= host_budget_bytes)
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        on_device = [p for p in predictions if p.peak_bytes <= limit]
        if on_device:
            least = min(on_device, key=lambda p: p.host_bytes)
            raise PlannerError(f"--host-budget={host_budget_bytes / 2**30:.4g} GiB is too small: the schedules that fit "
                               f"the device need at least {least.host_bytes / 2**30:.4g} GiB of host memory "
                               f"({least.schedule.mode})")
        smallest = min(predictions, key=lambda p: p.peak_bytes)
        raise PlannerError(f"budget={budget_bytes / 2**30:.4g} GiB is too small: the smallest predicted peak is "
                           f"{smallest.peak_bytes / 2**30:.4g} GiB ({smallest.schedule.mode})"
                           + ("" if stream or streaming_helps(probe_) else f"; {NOT_STREAMED}"), probe_, smallest)
    fastest = min(p.sec_per_step for p in fitting)
    tied = [p for p in fitting if p.sec_per_step <= fastest * (1 + TIE)]
    chosen = min(tied, key=lambda p: preference(p.schedule))
    return PlanChoice(budget_bytes, chosen, predictions, probe_, host_budget_bytes=host_budget_bytes)


NOT_STREAMED = ("weight streaming was not tried: on the CPU the device is host memory, so streaming saves no "
                "memory (ask for it with weight_offload=stream)")
"""What the planner says when nothing fits on the CPU and streaming was not asked for."""


def streaming_helps(probe_: Probe) -> bool:
    """Whether streaming frozen weights to host memory can lower the device's memory: not when
    the device is the host (the CPU), where the weights stay in the same memory."""
    return probe_.device != "cpu"


def fewest_streamed(probe_: Probe, schedule: CheckpointSchedule, limit: float,
                    asked: bool = False) -> list[Prediction]:
    """``schedule`` streaming the fewest blocks whose predicted peak is at most ``limit`` bytes
    (a bisection over the block count: the peak falls as blocks stream), or nothing when even
    streaming every block does not fit or streaming cannot help: a model without frozen block
    weights, or a device that is host memory (:func:`streaming_helps`) unless ``asked`` (the user
    set ``weight_offload=stream``)."""
    total = sum(len(costs) for costs in probe_.blocks.values())
    if not total or not probe_.frozen_block_bytes or not (asked or streaming_helps(probe_)):
        return []
    every = predict(probe_, schedule.replace(weight_offload="stream"))
    if every.peak_bytes > limit:
        return [every]
    low, high = 1, total
    while low < high:
        middle = (low + high) // 2
        if predict(probe_, schedule.replace(weight_offload="stream", weight_offload_blocks=middle)).peak_bytes <= limit:
            high = middle
        else:
            low = middle + 1
    return [predict(probe_, schedule.replace(weight_offload="stream",
                                             weight_offload_blocks=None if low == total else low))]


def parse_budget(value: str | float | int, device: str | torch.device = "cpu", key: str = "budget") -> int:
    """A budget in bytes (:func:`~..core.memory.budget_bytes`).

    Raises:
        PlannerError: not a budget; the message names ``key``.
    """
    try:
        return budget_bytes(value, device, key)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None


def write_choice(choice: PlanChoice, folder: str | Path) -> dict[str, Path]:
    """Write ``plan.txt`` (the rendered table) and ``schedule.json`` (the plan's option changes,
    :meth:`PlanChoice.options`, so that ``segckpt train --config schedule.json`` runs the plan
    chosen, a kept ``compile_blocks`` lever included) into ``folder``, atomically, and with
    :attr:`PlanChoice.ranks` ``nproc.json`` (its fields); return the paths."""
    folder = Path(folder)
    keys = choice.options()
    paths = {"text": atomic_write_text(folder / "plan.txt", choice.render() + "\n"),
             "schedule": atomic_write_text(folder / "schedule.json", json.dumps(keys, indent=2) + "\n")}
    if choice.ranks is not None:
        paths["nproc"] = atomic_write_text(folder / "nproc.json", json.dumps(choice.ranks.to_dict(), indent=2) + "\n")
    return paths


SENSITIVITY = (0.5, 2.0)
"""Factors on the calibrated offloader cost under which :func:`contenders` re-ranks."""


def contenders(choice: PlanChoice) -> list[Prediction]:
    """The fitting candidates worth timing, the chosen one first: the fastest fitting ones had the
    offloader cost half and twice what the probe calibrated (``SENSITIVITY``). The offloader's
    cost is one number from two short runs, and it decides between recomputing and offloading;
    recompute time comes from every block's own forward time. When no other calibration changes
    the ranking (e.g. ``none`` fits: nothing beats doing no extra work), only the chosen one."""
    picked = [choice.chosen]
    fitting = [p for p in choice.candidates if p.fits]
    for factor in SENSITIVITY:
        shifted = dataclasses.replace(choice.probe, offload_s_per_tensor=choice.probe.offload_s_per_tensor * factor,
                                      offload_s_per_byte=choice.probe.offload_s_per_byte * factor)
        times = {id(p): predict(shifted, p.schedule).sec_per_step for p in fitting}
        fastest = min(times.values())  # the choice :func:`choose` would make under that calibration
        best = min((p for p in fitting if times[id(p)] <= fastest * (1 + TIE)), key=lambda p: preference(p.schedule))
        if all(best is not q for q in picked):
            picked.append(best)
    return picked
