"""Schedule planner: pick the fastest checkpointing schedule that fits a memory budget.

One probe run (no checkpointing, :func:`~.training.train` itself, so the numbers are measured
exactly like a sweep cell) measures, per block of every block list:

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

plus the step's peak and sec/step. ``base`` = probe peak - all blocks' ``act`` is what the step
holds besides block activations. For a candidate schedule the model then predicts (see
:func:`predict`):

* what each block keeps until backward: ``act`` when plain (minus ``attn`` with attention
  offload); a whole-block segment keeps only its first block's ``carried`` inputs (nothing with
  ``unsloth``: they wait in host memory); an FFN-checkpointed block keeps ``act - ffn +
  ffn_in`` (``- ffn_in`` more with ``unsloth-ffn``);
* the peak = ``base`` + the largest of: everything kept at the end of forward, or, for each
  block / segment in backward order, what the blocks before it keep plus its own full
  activations (a segment is recomputed whole, so its interior is alive at once);
* sec/step = probe sec/step + recomputed forward seconds + the offloader's cost per offloaded
  tensor and byte (calibrated by one short run with attention offload: its extra time over the
  probe, divided by the tensors and bytes it offloaded).

The planner returns the fastest predicted schedule whose predicted peak fits; predictions within
``TIE`` of each other follow the documents' decision rule (seeds/001 "How to decide"): no
checkpointing, then ``torch-ffn``, ``torch``, ``unsloth-ffn``, ``unsloth``; plain over offload;
the larger interval and stride. :func:`plan_for_budget` can then measure the chosen schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic import atomic_write_text
from .config import TrainConfig
from .families import get_family
from .families.base import FamilyAdapter
from .plan import check_supported, effective_plan
from .schedule import CheckpointSchedule, ScheduleError
from .sweep import short_run, sweep_schedules

TIE = 0.03
"""Relative sec/step difference under which two predictions count as equal."""
_BACKEND_ORDER = {"torch-ffn": 0, "torch": 1, "unsloth-ffn": 2, "unsloth": 3}


class PlannerError(ValueError):
    """The budget is invalid, or no candidate schedule is predicted to fit it."""


@dataclass
class BlockCost:
    """Measured cost of one block (bytes, seconds); see the module docstring."""

    list_name: str
    index: int
    act: int = 0
    carried: int = 0
    ffn: int = 0
    ffn_in: int = 0
    attn: int = 0
    fwd_s: float = 0.0
    ffn_s: float = 0.0
    fwd_peak: int = 0
    grad: int = 0
    ffn_in_attn: int = 0
    attn_tensors: int = 0


@dataclass
class Probe:
    """What one probe run measured.

    Attributes:
        family: family name. device: ``cpu`` or ``cuda``.
        blocks: per-list block costs, in forward order of the lists.
        peak_bytes: the probe step's peak (same scope as a sweep cell). sec_per_step: its time.
        offload_s_per_tensor / offload_s_per_byte: cost of one tensor kept in host memory by the
            engine's offloader (pack and unpack), calibrated by one short attention-offload run.
        blocks_end_bytes: tracked memory right after the last block's forward (CPU tracker).
    """

    family: str
    device: str
    blocks: dict[str, list[BlockCost]]
    peak_bytes: int
    sec_per_step: float
    offload_s_per_tensor: float
    offload_s_per_byte: float
    blocks_end_bytes: int | None = None

    @property
    def activation_bytes(self) -> int:
        """All blocks' saved activations, bytes."""
        return sum(b.act for costs in self.blocks.values() for b in costs)

    @property
    def base_bytes(self) -> int:
        """Bytes of the step at its peak besides block activations (never negative); it holds the
        backward transient of the gradients."""
        return max(0, self.peak_bytes - self.activation_bytes)

    @property
    def forward_base_bytes(self) -> int:
        """Bytes besides block activations while the blocks run forward (no gradients yet)."""
        if self.blocks_end_bytes is None:
            return self.base_bytes
        return max(0, min(self.base_bytes, self.blocks_end_bytes - self.activation_bytes))


@dataclass
class Prediction:
    """Predicted peak (bytes) and sec/step of one candidate schedule."""

    schedule: CheckpointSchedule
    peak_bytes: int
    sec_per_step: float
    fits: bool = False


@dataclass
class PlanChoice:
    """The planner's answer.

    Attributes:
        budget_bytes: the budget. chosen: the prediction picked. candidates: every prediction.
        measured_sec_per_step / measured_peak_bytes: the chosen schedule run for real (when
            :func:`plan_for_budget` was asked to measure), else ``None``.
    """

    budget_bytes: int
    chosen: Prediction
    candidates: list[Prediction]
    probe: Probe
    measured_sec_per_step: float | None = None
    measured_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """A table of the candidates (predicted sec/step / peak GiB), the chosen one marked."""
        lines = [f"budget {self.budget_bytes / 2**30:.4g} GiB; probe: {self.probe.sec_per_step:.3f} sec/step, "
                 f"peak {self.probe.peak_bytes / 2**30:.4g} GiB without checkpointing",
                 f"{'':2}{'mode':<44} {'predicted sec/step / peak GiB':>30}   (-> chosen, x predicted over "
                 f"the budget less {MARGIN:.0%} headroom)"]
        for p in sorted(self.candidates, key=lambda p: p.sec_per_step):
            mark = "->" if p is self.chosen else ("  " if p.fits else " x")
            lines.append(f"{mark}{p.schedule.mode:<44} {p.sec_per_step:>9.3f} / {p.peak_bytes / 2**30:.4g}")
        if self.measured_sec_per_step is not None:
            lines.append(f"measured {self.chosen.schedule.mode}: {self.measured_sec_per_step:.3f} sec/step / "
                         f"{self.measured_peak_bytes / 2**30:.4g} GiB")
        lines.extend(self.notes)
        return "\n".join(lines)


@dataclass
class _Seen:
    """Raw observations of one block call (storage pointers -> bytes)."""

    saved: dict[int, tuple[int, bool, bool]] = field(default_factory=dict)  # ptr -> (bytes, in ffn, in attn)
    inputs: list[tuple[Any, int, int]] = field(default_factory=list)  # (arg key, ptr, bytes)
    outputs: set[int] = field(default_factory=set)
    ffn_inputs: dict[int, int] = field(default_factory=dict)  # ptr -> bytes
    window: tuple[int, int] | None = None


def _tracker():
    """The CPU live-tensor tracker measuring the current step, if one is active."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from .memory import LiveTensorTracker

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, LiveTensorTracker):
            return mode
    return None


class _Collector:
    """Module and saved-tensor hooks that attribute saved bytes and forward time to blocks.

    Observations are kept raw and resolved by :meth:`costs` after the step: an input whose
    storage is the previous block's output is carried; one passed unchanged to several blocks
    (time embedding, rotary tables) is shared and belongs to ``base``; a storage saved by
    several blocks counts for the first.
    """

    def __init__(self, model: torch.nn.Module, family: FamilyAdapter, sync: Callable[[], None]):
        self.active = False
        self.sync = sync
        self.scopes: list[tuple[str, int, float]] = []
        self.resident: set[int] = set()
        self.lists = [(bl.name, list(family.blocks(model, bl))) for bl in family.block_lists]
        self.seen: dict[tuple[str, int], _Seen] = {}
        self.costs_: dict[tuple[str, int], BlockCost] = {}
        self.handles = []
        self.blocks_end_bytes: int | None = None
        for bl, (name, blocks) in zip(family.block_lists, self.lists):
            for i, block in enumerate(blocks):
                key = (name, i)
                self.seen[key], self.costs_[key] = _Seen(), BlockCost(name, i)
                self._scope(block, "block", key)
                if bl.ffn:  # a chain (Flux single: act_mlp(proj_mlp(x))) is one scope, first to last
                    names = (bl.ffn,) if isinstance(bl.ffn, str) else bl.ffn
                    self._scope(block.get_submodule(names[0]), "ffn", key, block.get_submodule(names[-1]))
                if bl.attention:
                    self._scope(block.get_submodule(bl.attention), "attn", key)

    def _scope(self, module, kind, key, last=None) -> None:
        def pre(_module, args, kwargs):
            if not self.active:
                return
            self.sync()
            seen = self.seen[key]
            if kind == "block":
                seen.inputs = [(k, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                               for k, t in [*enumerate(args), *kwargs.items()] if isinstance(t, torch.Tensor)]
            elif kind == "ffn":
                seen.ffn_inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                   for t in args if isinstance(t, torch.Tensor)}
            tracker = _tracker()
            if kind == "block" and tracker is not None:  # a window for this block's own peak
                seen.window = (tracker.current_bytes, tracker.peak_bytes)
                tracker.peak_bytes = tracker.current_bytes
            self.scopes.append((kind, key, time.perf_counter()))

        def post(_module, _args, _kwargs, output):
            if not self.active or not self.scopes:
                return
            self.sync()
            kind_, key_, started = self.scopes.pop()
            cost = self.costs_[key_]
            if kind_ == "block":
                cost.fwd_s += time.perf_counter() - started
                tracker, window = _tracker(), self.seen[key_].window
                if tracker is not None and window is not None:
                    cost.fwd_peak = max(cost.fwd_peak, tracker.peak_bytes - window[0])
                    tracker.peak_bytes = max(tracker.peak_bytes, window[1])  # the step's peak is kept
                    self.blocks_end_bytes = tracker.current_bytes  # after the last block: forward's end
                outputs = output if isinstance(output, (tuple, list)) else [output]
                self.seen[key_].outputs = {t.untyped_storage().data_ptr() for t in outputs if isinstance(t, torch.Tensor)}
            elif kind_ == "ffn":
                cost.ffn_s += time.perf_counter() - started

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append((last or module).register_forward_hook(post, with_kwargs=True))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active and self.scopes and isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            kinds = {kind for kind, _, _ in self.scopes}
            saved = self.seen[self.scopes[-1][1]].saved
            if storage.data_ptr() not in saved:
                saved[storage.data_ptr()] = (storage.nbytes(), "ffn" in kinds, "attn" in kinds)
        return tensor

    def costs(self) -> dict[str, list[BlockCost]]:
        """Resolve the raw observations into per-block costs."""
        credited: set[int] = set(self.resident)
        result: dict[str, list[BlockCost]] = {}
        for name, blocks in self.lists:
            seen = [self.seen[(name, i)] for i in range(len(blocks))]
            pointer_uses: dict[int, int] = {}
            for s in seen:
                for ptr in {ptr for _, ptr, _ in s.inputs}:
                    pointer_uses[ptr] = pointer_uses.get(ptr, 0) + 1
            shared = {ptr for ptr, uses in pointer_uses.items() if uses > 1}
            carried_keys: set = set()
            for i in range(1, len(seen)):
                carried_keys |= {k for k, ptr, _ in seen[i].inputs if ptr in seen[i - 1].outputs}
            costs = []
            for i, s in enumerate(seen):
                cost = self.costs_[(name, i)]
                cost.grad = sum(p.numel() * p.element_size() for p in blocks[i].parameters() if p.requires_grad)
                cost.carried = sum(n for k, ptr, n in s.inputs if k in carried_keys and ptr not in shared)
                for ptr, (nbytes, in_ffn, in_attn) in s.saved.items():
                    if ptr in shared or ptr in credited:
                        continue
                    credited.add(ptr)
                    cost.act += nbytes
                    cost.ffn += nbytes if in_ffn else 0
                    cost.attn += nbytes if in_attn else 0
                    cost.attn_tensors += 1 if in_attn else 0
                # what a checkpoint of the FFN keeps that plain execution does not: its input,
                # unless the block saves it outside the FFN anyway (a frozen linear saves nothing)
                cost.ffn_in = sum(n for ptr, n in s.ffn_inputs.items()
                                  if ptr not in shared and not (ptr in s.saved and not s.saved[ptr][1]))
                # an FFN input the attention saves too (Flux single blocks): attention offload
                # cannot free it while a torch-ffn checkpoint holds it
                cost.ffn_in_attn = sum(n for ptr, n in s.ffn_inputs.items()
                                       if ptr in s.saved and s.saved[ptr][2] and not s.saved[ptr][1])
                costs.append(cost)
            result[name] = costs
        return result

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _offload_cost(config: TrainConfig, bundle, warmup_steps: int, trainer, none_sec: float,
                  tensors: int, nbytes: int) -> tuple[float, float]:
    """(seconds per offloaded tensor, seconds per offloaded byte) of the engine's offloader on this
    machine: one short run with attention offload and no checkpointing, against the probe's
    sec/step, divided by what it offloads (0 when the family has no attention boundary)."""
    if not tensors:
        return 0.0, 0.0
    result = short_run(config, bundle, CheckpointSchedule(gradient_checkpointing=False,
                                                          gradient_checkpointing_offload_attention=True),
                       warmup_steps, 2, trainer)
    extra = max(0.0, result.report["totals"]["sec_per_step"] - none_sec)
    # split between per-tensor bookkeeping and per-byte copies: copies at the measured memcpy rate
    per_byte = _copy_seconds_per_byte(torch.device(result.report["environment"]["device"]))
    per_tensor = max(0.0, extra - per_byte * nbytes) / tensors
    return per_tensor, per_byte


def _copy_seconds_per_byte(device: torch.device) -> float:
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


def probe(config: TrainConfig, bundle, warmup_steps: int = 1,
          trainer: Callable[..., Any] | None = None) -> Probe:
    """Measure per-block activation bytes and forward time on one step without checkpointing.

    Args:
        config: the run settings (data, resolution, batch, device, ...); the schedule, steps
            and output are replaced.
        bundle: the loaded model (never changed: the probe trains a deep copy).
        warmup_steps: steps before the measured one.
        trainer: the training entry point (default :func:`~.training.train`).
    """
    from .training import resolve_device, train

    trainer = trainer or train
    family = get_family(bundle.family.name)
    device = resolve_device(config)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="segckpt-probe-") as folder, torch.inference_mode(False):
        model_copy = dataclasses.replace(bundle, transformer=copy.deepcopy(bundle.transformer))
        # LoRA is added inside train(); hooks attach to the blocks, which train() keeps
        collector = _Collector(model_copy.transformer, family, sync)
        # warm-up steps, the recorded step (hooks active), then one clean step for sec/step
        probe_config = dataclasses.replace(
            config, schedule=CheckpointSchedule(gradient_checkpointing=False), steps=warmup_steps + 2,
            timing_warmup_steps=warmup_steps, output=folder, resume=False, save_every=0)

        def activate() -> None:  # after train() added the LoRA: its weights are resident too
            model = model_copy.transformer
            collector.resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
            collector.active = True

        def on_step(record, total):
            if record.step == warmup_steps:  # record the step after the warm-up
                activate()
            else:
                collector.active = False

        if warmup_steps == 0:
            raise PlannerError("warmup_steps=0 is invalid: allowed >= 1 (the probe records after train() set up LoRA)")
        try:
            with torch.autograd.graph.saved_tensors_hooks(collector.pack, lambda t: t):
                result = trainer(probe_config, bundle=model_copy, on_step=on_step, log=lambda line: None)
        finally:
            collector.close()
    recorded, clean = result.history[warmup_steps], result.history[-1]
    costs = collector.costs()
    routed_attention = {bl.name for bl in family.block_lists if bl.attention and bl.routed}
    attn = [c for name, cs in costs.items() if name in routed_attention for c in cs]
    per_tensor, per_byte = _offload_cost(config, bundle, warmup_steps, trainer, clean["seconds"],
                                         sum(c.attn_tensors for c in attn), sum(c.attn for c in attn))
    return Probe(family.name, device.type, costs, max(recorded["peak_bytes"], clean["peak_bytes"]),
                 clean["seconds"], per_tensor, per_byte, collector.blocks_end_bytes)


def predict(probe_: Probe, schedule: CheckpointSchedule) -> Prediction:
    """Predicted peak bytes and sec/step of ``schedule`` (see the module docstring).

    Raises:
        ScheduleError: the family cannot run ``schedule``.
    """
    family = get_family(probe_.family)
    counts = {name: len(costs) for name, costs in probe_.blocks.items()}
    plan = effective_plan(family, schedule, counts, warn=False)
    backend = schedule.gradient_checkpointing_backend if schedule.gradient_checkpointing else None
    ffn_scope = backend in ("torch-ffn", "unsloth-ffn")
    offload_attn = schedule.gradient_checkpointing_offload_attention
    kept_before = 0
    worst = forward_worst = 0
    seconds = probe_.sec_per_step
    tensors = 0
    # backward runs last block first: when block b's backward runs, the gradients of every later
    # block already exist (they stay until the optimizer step)
    grads_after, total = {}, sum(c.grad for costs in probe_.blocks.values() for c in costs)
    running = 0
    for name in probe_.blocks:
        for c in probe_.blocks[name]:
            running += c.grad
            grads_after[(name, c.index)] = total - running
    copied = 0
    for list_plan, block_list in zip(plan.lists, family.block_lists):
        costs = probe_.blocks[list_plan.name]
        starts = dict(list_plan.segments)
        checkpointed = set(list_plan.checkpointed)
        i = 0
        while i < len(costs):
            cost = costs[i]
            attn_off = cost.attn if offload_attn and block_list.attention and block_list.routed else 0
            if not ffn_scope and i in starts:  # whole-block segment [i, end): recomputed as one
                end = starts[i]
                segment = costs[i:end]
                keep = 0 if backend == "unsloth" else cost.carried
                if backend == "unsloth":
                    copied += cost.carried
                    tensors += len(block_list.carry.links)
                # backward of the segment: all its activations; its recompute: the last block's
                # forward transient on top of the others' activations (no gradients alive yet)
                worst = max(worst, kept_before + sum(c.act for c in segment) + grads_after[(list_plan.name, end - 1)])
                forward_worst = max(forward_worst, kept_before + sum(c.act for c in segment[:-1]) + segment[-1].fwd_peak)
                seconds += sum(c.fwd_s for c in segment)
                kept_before += keep
                i = end
                continue
            if ffn_scope and i in checkpointed and block_list.ffn:
                keep = cost.act - cost.ffn + (cost.ffn_in if backend == "torch-ffn" else 0) - attn_off
                if attn_off and backend == "torch-ffn":
                    keep += cost.ffn_in_attn
                if backend == "unsloth-ffn":
                    copied += cost.ffn_in
                    tensors += 1
                seconds += cost.ffn_s
            else:
                keep = cost.act - attn_off
            copied += attn_off
            tensors += cost.attn_tensors if attn_off else 0
            # offloaded attention activations come back late in the block's backward, after the
            # FFN's and the block's other transients are freed: they do not raise its peak
            own = cost.act - attn_off
            worst = max(worst, kept_before + own + grads_after[(list_plan.name, i)])
            kept_before += keep
            i += 1
    peak = max(probe_.base_bytes + max(worst, kept_before), probe_.forward_base_bytes + forward_worst)
    seconds += tensors * probe_.offload_s_per_tensor + copied * probe_.offload_s_per_byte
    return Prediction(schedule, int(peak), seconds)


def _preference(schedule: CheckpointSchedule) -> tuple:
    """The documents' decision rule as a sort key (smaller = preferred on a tie)."""
    if not schedule.gradient_checkpointing:
        return (0,)
    return (1, schedule.gradient_checkpointing_offload_attention,
            _BACKEND_ORDER[schedule.gradient_checkpointing_backend], -schedule.interval, -schedule.stride)


MARGIN = 0.05
"""Headroom: a candidate fits when its predicted peak is at most ``(1 - MARGIN)`` of the budget."""


def choose(probe_: Probe, budget_bytes: int, candidates: list[CheckpointSchedule] | None = None,
           margin: float = MARGIN) -> PlanChoice:
    """The fastest schedule whose predicted peak fits ``budget_bytes`` with ``margin`` headroom.

    Raises:
        PlannerError: no supported candidate is predicted to fit (the message gives the
            smallest predicted peak).
    """
    family = get_family(probe_.family)
    predictions = []
    for schedule in candidates or sweep_schedules():
        try:
            check_supported(family, schedule)
        except ScheduleError:
            continue
        prediction = predict(probe_, schedule)
        prediction.fits = prediction.peak_bytes <= budget_bytes * (1 - margin)
        predictions.append(prediction)
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        smallest = min(predictions, key=lambda p: p.peak_bytes)
        raise PlannerError(f"budget={budget_bytes / 2**30:.4g} GiB is too small: the smallest predicted peak is "
                           f"{smallest.peak_bytes / 2**30:.4g} GiB ({smallest.schedule.mode})")
    fastest = min(p.sec_per_step for p in fitting)
    tied = [p for p in fitting if p.sec_per_step <= fastest * (1 + TIE)]
    chosen = min(tied, key=lambda p: _preference(p.schedule))
    return PlanChoice(budget_bytes, chosen, predictions, probe_)


def device_budget(device: str | torch.device) -> int:
    """"Fit this device": total accelerator memory (CUDA), else total system memory, in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_budget(value: str | float | int, device: str | torch.device = "cpu", key: str = "budget") -> int:
    """A budget in bytes from ``"device"`` or a number of GiB.

    Raises:
        PlannerError: not ``device`` nor a finite positive number; the message names ``key``.
    """
    if isinstance(value, str) and value.strip().lower() in ("device", "fit this device"):
        return device_budget(device)
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = -1.0
    if not 0 < gib < 2**20:  # also refuses nan and inf
        raise PlannerError(f"{key}={value!r} is invalid: allowed a number of GiB > 0 (below 1 PiB), or 'device'")
    return int(gib * 2**30)


def write_choice(choice: PlanChoice, folder: str | Path) -> dict[str, Path]:
    """Write ``plan.txt`` (the rendered table) and ``schedule.json`` (the chosen keys, usable as
    ``segckpt train --config``) into ``folder``, atomically; return both paths."""
    folder = Path(folder)
    keys = choice.chosen.schedule.to_dict()
    return {"text": atomic_write_text(folder / "plan.txt", choice.render() + "\n"),
            "schedule": atomic_write_text(folder / "schedule.json", json.dumps(keys, indent=2) + "\n")}


def plan_for_budget(config: TrainConfig, bundle, budget_bytes: int, measure_steps: int = 0,
                    warmup_steps: int = 1, trainer: Callable[..., Any] | None = None,
                    max_tries: int = 4) -> PlanChoice:
    """Probe, choose, and (``measure_steps`` > 0) run the chosen schedule to measure it.

    When the measured peak of the steps after warm-up exceeds the budget, that candidate is
    marked as not fitting and the next one is chosen and measured, at most ``max_tries`` times.

    Raises:
        PlannerError: nothing is predicted to fit, or no tried candidate fits when measured.
    """
    measured_probe = probe(config, bundle, warmup_steps, trainer)
    excluded: list[str] = []
    notes: list[str] = []
    for _ in range(max_tries):
        candidates = [s for s in sweep_schedules() if s.mode not in excluded]
        choice = choose(measured_probe, budget_bytes, candidates)
        choice.notes = notes
        if measure_steps <= 0:
            return choice
        result = short_run(config, bundle, choice.chosen.schedule, warmup_steps, measure_steps, trainer)
        choice.measured_sec_per_step = result.report["totals"]["sec_per_step"]
        choice.measured_peak_bytes = max(h["peak_bytes"] for h in result.history[warmup_steps:])
        if choice.measured_peak_bytes <= budget_bytes:
            return choice
        notes.append(f"{choice.chosen.schedule.mode} measured {choice.measured_peak_bytes / 2**30:.4g} GiB, over the "
                     f"budget (predicted {choice.chosen.peak_bytes / 2**30:.4g}): tried the next candidate")
        excluded.append(choice.chosen.schedule.mode)
    raise PlannerError(f"budget={budget_bytes / 2**30:.4g} GiB: none of the {max_tries} candidates tried fits when "
                       f"measured ({'; '.join(notes)})")
