"""The planner's probe: per-block activation bytes and time, measured on one training step.

One training run (:class:`~..train.loop.TrainingRun`) without checkpointing (so the numbers are measured
exactly like a sweep cell) records, through module hooks and a saved-tensor hook, per block of
every block list (see :class:`BlockCost`): the bytes it saves for backward and the FFN and
attention parts of them, its carried inputs, its forward time and forward transient, and its
trainable (LoRA) bytes, the tensors it saves; plus the step's peak and sec/step (the median of
clean steps and of the calibration's plain run). Short runs in lockstep then calibrate the per-tensor costs of recompute, offload and
streaming on this machine (:func:`~.costs.calibrate`).
:mod:`.planner` predicts every candidate schedule from the resulting :class:`Probe`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.module_tracker import ModuleTracker

from ..core.memory import PeakMemory
from ..core.offload import copy_key, resident_storages
from ..core.plan import count_blocks
from ..families import get_family
from ..families.base import FamilyAdapter
from ..model.loading import resolve_device
from ..model.precision import tensor_bytes
from ..train.recovery import OutOfMemoryStop
from .costs import (
    PLAIN,
    BlockCost,
    Calibration,
    calibrate,
    calibration_key,
    calibration_schedules,
    calibration_steps,
    copy_seconds_per_byte,
    remember_calibration,
    remembered_calibration,
)
from .runs import RunWorkspace


@dataclass
class Probe:
    """What one probe run measured.

    Attributes:
        family: family name. device: ``cpu`` or ``cuda``.
        blocks: per-list block costs, in forward order of the lists.
        peak_bytes: the probe step's device peak (same scope as a sweep cell: with the weights the
            device holds, on the CPU too). sec_per_step: its time.
        offload_s_per_tensor / offload_s_per_byte / recompute_s_per_call / recompute_s_per_tensor /
            stream_s_per_tensor: this machine's :class:`~.costs.Calibration` (short runs in lockstep).
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
    validation_peak_bytes: int = 0
    """Peak of the preview phase when the probe run sampled previews (else 0)."""
    frozen_block_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Per list, per block: bytes of the block's frozen weights (what streaming takes off the device)."""
    h2d_s_per_byte: float = 0.0
    """Seconds per byte of one host-to-device copy on this machine (weight streaming's cost)."""
    optimizer_block_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Per list, per block: bytes of the optimizer's state of the block's LoRA (the run's optimizer:
    AdamW's two fp32 moments, AdamW8bit's codes and scales, Adafactor's factors, Prodigy's four)."""
    held_bytes: int = 0
    """Device bytes held before the step starts (weights, LoRA, optimizer state): part of
    ``peak_bytes``, which no schedule changes (streaming moves the frozen part to the host)."""
    recompute_s_per_call: float = 0.0
    recompute_s_per_tensor: float = 0.0
    stream_s_per_tensor: float = 0.0
    extrapolated_from: int = 0
    """0: every block was measured. k: the plain step did not fit, so a copy of the model with its
    first k blocks per list was measured and its last block stands for the others
    (:func:`shallow_probe`)."""

    @property
    def calibration(self) -> Calibration:
        """The per-tensor costs measured for this probe (:func:`~.costs.calibrate`)."""
        return Calibration(self.offload_s_per_tensor, self.offload_s_per_byte, self.recompute_s_per_call,
                           self.recompute_s_per_tensor, self.stream_s_per_tensor)

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
class _Seen:
    """Raw observations of one block call (storage pointers -> bytes)."""

    saved: dict[int, tuple[int, bool, bool]] = field(default_factory=dict)  # ptr -> (bytes, in ffn, in attn)
    inputs: list[tuple[Any, int, int]] = field(default_factory=list)  # (arg key, ptr, bytes)
    outputs: set[int] = field(default_factory=set)
    ffn_inputs: dict[int, int] = field(default_factory=dict)  # ptr -> bytes
    window: tuple[int, int] | None = None
    attn_copies: dict[tuple, int] = field(default_factory=dict)  # what attention offload copies -> bytes


class _Collector:
    """Module and saved-tensor hooks that attribute saved bytes and forward time to blocks.

    Which block, FFN and attention sub-module a saved tensor belongs to is read from torch's
    :class:`~torch.utils.module_tracker.ModuleTracker` (the modules running when it is saved);
    per-block pre/post hooks record inputs, outputs, forward time and the forward transient.
    Observations are kept raw and resolved by :meth:`costs` after the step: an input whose
    storage is the previous block's output is carried; one passed unchanged to several blocks
    (time embedding, rotary tables) is shared and belongs to ``base``; a storage saved by
    several blocks counts for the first.
    """

    def __init__(self, model: torch.nn.Module, family: FamilyAdapter, sync: Callable[[], None]):
        self.active = False  # recording bytes (the recorded step)
        self.timing = False  # timing blocks (the clean steps after it)
        self.sync = sync
        self.seconds: dict[tuple[str, tuple[str, int]], list[float]] = {}  # per block and FFN: one per clean step
        self.modules = ModuleTracker()
        self.memory: PeakMemory | None = None  # the run's meter: its CPU tracker gives the transient
        self.resident: set[int] = set()
        self.lists = [(bl.name, list(family.blocks(model, bl))) for bl in family.block_lists]
        self.seen: dict[tuple[str, int], _Seen] = {}
        self.costs_: dict[tuple[str, int], BlockCost] = {}
        self.started: dict[tuple[str, tuple[str, int]], float] = {}
        self.handles = []
        self.blocks_end_bytes: int | None = None
        # ModuleTracker names a module by its root's class and its path: "FluxTransformer2DModel.transformer_blocks.0"
        path = {module: f"{type(model).__name__}.{name}" for name, module in model.named_modules() if name}
        self.scopes: dict[str, tuple[str, tuple[str, int]]] = {}
        for bl, (name, blocks) in zip(family.block_lists, self.lists):
            for i, block in enumerate(blocks):
                key = (name, i)
                self.seen[key], self.costs_[key] = _Seen(), BlockCost(name, i)
                self._hooks(block, "block", key)
                self.scopes[path[block]] = ("block", key)
                if bl.ffn:  # a chain (Flux single: act_mlp(proj_mlp(x))) is one scope, first to last
                    names = (bl.ffn,) if isinstance(bl.ffn, str) else bl.ffn
                    chain = [block.get_submodule(n) for n in names]
                    self._hooks(chain[0], "ffn", key, chain[-1])
                    self.scopes.update({path[m]: ("ffn", key) for m in chain})
                if bl.attention:
                    self.scopes[path[block.get_submodule(bl.attention)]] = ("attn", key)

    def _tracker(self):
        return self.memory.tracker if self.memory is not None else None

    def _hooks(self, module, kind, key, last=None) -> None:
        def pre(_module, args, kwargs):
            if not (self.active or self.timing):
                return
            self.sync()
            if not self.active:
                self.started[(kind, key)] = time.perf_counter()
                return
            seen = self.seen[key]
            if kind == "block":
                seen.inputs = [(k, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                               for k, t in [*enumerate(args), *kwargs.items()] if isinstance(t, torch.Tensor)]
                tracker = self._tracker()
                if tracker is not None:  # a window for this block's own peak
                    seen.window = (tracker.current_bytes, tracker.peak_bytes)
                    tracker.peak_bytes = tracker.current_bytes
            else:
                seen.ffn_inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                   for t in args if isinstance(t, torch.Tensor)}
            self.started[(kind, key)] = time.perf_counter()

        def post(_module, _args, _kwargs, output):
            if not (self.active or self.timing) or (kind, key) not in self.started:
                return
            self.sync()
            elapsed = time.perf_counter() - self.started.pop((kind, key))
            if not self.active:
                self.seconds.setdefault((kind, key), [0.0])[-1] += elapsed
                return
            if kind == "ffn":
                return
            cost = self.costs_[key]
            tracker, window = self._tracker(), self.seen[key].window
            if tracker is not None and window is not None:
                cost.fwd_peak = max(cost.fwd_peak, tracker.peak_bytes - window[0])
                tracker.peak_bytes = max(tracker.peak_bytes, window[1])  # the step's peak is kept
                self.blocks_end_bytes = tracker.current_bytes  # after the last block: forward's end
            outputs = output if isinstance(output, (tuple, list)) else [output]
            self.seen[key].outputs = {t.untyped_storage().data_ptr() for t in outputs if isinstance(t, torch.Tensor)}

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append((last or module).register_forward_hook(post, with_kwargs=True))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (self.active and isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided
                and not is_traceable_wrapper_subclass(tensor)):
            return tensor
        running = [self.scopes[name] for name in self.modules.parents if name in self.scopes]
        blocks = [key for kind, key in running if kind == "block"]
        if len(blocks) == 1:  # saved inside exactly one block (outside any block: base)
            kinds = {kind for kind, key in running if key == blocks[0]}
            storage = tensor.untyped_storage()
            seen, cost = self.seen[blocks[0]], self.costs_[blocks[0]]
            if storage.data_ptr() not in seen.saved:
                seen.saved[storage.data_ptr()] = (storage.nbytes(), "ffn" in kinds, "attn" in kinds)
            # every saved tensor passes through the saved-tensor hooks of a checkpoint or a streamed block
            cost.saved_tensors += 1
            cost.ffn_tensors += "ffn" in kinds
            if "attn" in kinds and tensor.numel() and storage.data_ptr() not in self.resident:
                # one copy per key, as the offloader makes them (engine/core/offload.py)
                seen.attn_copies[copy_key(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    def costs(self) -> dict[str, list[BlockCost]]:
        """Resolve the raw observations into per-block costs."""
        credited: set[int] = set(self.resident)
        for (kind, key), seconds in self.seconds.items():  # the median clean step's time
            setattr(self.costs_[key], "ffn_s" if kind == "ffn" else "fwd_s", statistics.median(seconds))
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
                cost.attn_tensors, cost.attn_copied = len(s.attn_copies), sum(s.attn_copies.values())
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

    def next_timing_step(self) -> None:
        """Start timing one more clean step (each block's and FFN's seconds start at 0)."""
        self.timing = True
        for seconds in self.seconds.values():
            seconds.append(0.0)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


TIMING_STEPS = 3
"""Clean steps after the recorded one: sec/step and each block's forward seconds are their medians."""


def probe_steps(warmup_steps: int, calibrate: bool = True) -> int:
    """The steps one probe runs: its plain run (:func:`plain_steps`) and, with ``calibrate`` (no
    calibration given), the calibration runs (:func:`~.costs.calibration_steps`); what a
    caller announces to its workspace (:meth:`~.runs.RunWorkspace.expect`) before probing. A
    family without attention activations to offload skips that calibration run, a config that
    streams weights adds one (streaming's), and the probe corrects the announced total. A caller's
    first probe calibrates unless the process remembers a calibration for it
    (:func:`first_probe_steps`)."""
    return plain_steps(warmup_steps) + (calibration_steps(warmup_steps) if calibrate else 0)


def first_probe_steps(workspace: RunWorkspace, warmup_steps: int) -> int:
    """:func:`probe_steps` of the workspace's first probe: no calibration runs where it takes a remembered one."""
    return probe_steps(warmup_steps, remembered_calibration(calibration_key(workspace, warmup_steps)) is None)


def plain_steps(warmup_steps: int) -> int:
    """Steps of the probe's plain run: warm-up, the recorded step, :data:`TIMING_STEPS` clean ones."""
    return warmup_steps + 1 + TIMING_STEPS


SHALLOW_BLOCKS = 2
"""Blocks per list of the copy :func:`shallow_probe` measures when the plain step does not fit."""


def probe(workspace: RunWorkspace, warmup_steps: int = 1, rows: list[int] | None = None,
          calibration: Calibration | None = None, shallow: int | None = None, **changes) -> Probe:
    """Measure per-block activation bytes and forward time on one step without checkpointing.

    When that step runs out of memory (the weights and every block's activations do not fit the
    device at once), the probe measures a copy of the model with :data:`SHALLOW_BLOCKS` blocks per
    list instead (:func:`shallow_probe`); ``shallow`` = k asks for that directly.

    Args:
        workspace: an open workspace (:class:`~.runs.RunWorkspace`: the run settings - data,
            resolution, batch, device, ...; the schedule, steps and output are replaced - and the
            loaded model, never changed: the probe trains a deep copy; shared data and latent cache).
        warmup_steps: steps before the measured one (>= 1: the first sets the run up).
        rows: probe batches of these cache rows only (one bucket: one shape).
        calibration: the :class:`~.costs.Calibration` of an earlier probe on this machine
            (:attr:`Probe.calibration`; skips the calibration runs). Without it, the one this
            process measured last for the same model and settings
            (:func:`~.costs.remembered_calibration`), else the calibration runs measure one.
        changes: other settings of the probe run (e.g. ``validation_every``).

    Raises:
        ValueError: ``warmup_steps`` < 1.
    """
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps} is invalid: allowed >= 1 (the probe records after "
                         "the run set up its LoRA)")
    if shallow:
        return shallow_probe(workspace, shallow, warmup_steps, rows, calibration, **changes)
    try:
        return _probe_plain(workspace, warmup_steps, rows, calibration, **changes)
    except (OutOfMemoryStop, torch.OutOfMemoryError) as exc:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            return shallow_probe(workspace, SHALLOW_BLOCKS, warmup_steps, rows, calibration, **changes)
        except ShallowProbeError:
            raise exc from None


class ShallowProbeError(ValueError):
    """The model's block lists cannot be shortened for a shallow probe (a list is not a plain
    ``nn.ModuleList`` attribute of the model)."""


def shallow_copy(model: torch.nn.Module, family: FamilyAdapter, keep: int) -> torch.nn.Module:
    """A deep copy of ``model`` with only the first ``keep`` blocks of each of ``family``'s lists
    (same widths, same weights); the model itself is left as it was.

    Raises:
        ShallowProbeError: a list is not an ``nn.ModuleList`` attribute of the model.
    """
    lists = {}
    for block_list in family.block_lists:
        blocks = getattr(model, block_list.attr, None) if "." not in block_list.attr else None
        if not isinstance(blocks, torch.nn.ModuleList):
            raise ShallowProbeError(f"{family.name} list {block_list.name!r} ({block_list.attr}) is not a ModuleList "
                                    "of the model: no shallow probe")
        lists[block_list.attr] = blocks
    try:
        for attr, blocks in lists.items():
            model._modules[attr] = torch.nn.ModuleList(list(blocks)[:keep])
        with torch.inference_mode(False):
            return copy.deepcopy(model)
    finally:
        for attr, blocks in lists.items():
            model._modules[attr] = blocks


def shallow_probe(workspace: RunWorkspace, keep: int, warmup_steps: int, rows: list[int] | None = None,
                  calibration: Calibration | None = None, **changes) -> Probe:
    """The probe of a model whose plain step does not fit: one plain step (in the open ``workspace``)
    of a copy of its model with the first ``keep`` blocks of every list, its last block standing for the blocks left out (a list's
    blocks have the same shapes and widths, so the same activation bytes, forward time, LoRA and
    frozen bytes). The left-out blocks add their activations, their frozen and LoRA bytes (with
    the optimizer's state of the LoRA, as the last block's was measured) to the peak and three
    forward times each (forward and about twice that in backward) to sec/step.

    Raises:
        ShallowProbeError: see :func:`shallow_copy`.
    """
    bundle = workspace.bundle
    family = get_family(bundle.family.name)
    counts = count_blocks(family, bundle.transformer)
    small = dataclasses.replace(bundle, transformer=shallow_copy(bundle.transformer, family, keep))
    original, workspace.bundle = workspace.bundle, small
    try:
        measured = _probe_plain(workspace, warmup_steps, rows, calibration, **changes)
    finally:
        workspace.bundle = original
    blocks, frozen, states = {}, {}, {}
    added_act = added_lora = added_frozen = added_state = 0
    added_s = 0.0
    for name, costs in measured.blocks.items():
        template, extra = costs[-1], counts[name] - len(costs)
        blocks[name] = costs + [dataclasses.replace(template, index=i) for i in range(len(costs), counts[name])]
        frozen[name] = measured.frozen_block_bytes[name] + [measured.frozen_block_bytes[name][-1]] * extra
        states[name] = measured.optimizer_block_bytes[name] + [measured.optimizer_block_bytes[name][-1]] * extra
        added_act += extra * template.act
        added_lora += extra * template.grad
        added_frozen += extra * frozen[name][-1]
        added_state += extra * states[name][-1]
        added_s += extra * 3 * template.fwd_s
    held = added_frozen + added_lora + added_state  # the frozen weights, the LoRA and its optimizer state
    grow = held + added_act
    return dataclasses.replace(
        measured, blocks=blocks, frozen_block_bytes=frozen, optimizer_block_bytes=states,
        peak_bytes=measured.peak_bytes + grow,
        sec_per_step=measured.sec_per_step + added_s, held_bytes=measured.held_bytes + held,
        blocks_end_bytes=None if measured.blocks_end_bytes is None else measured.blocks_end_bytes + grow,
        extrapolated_from=keep)


def _probe_plain(workspace: RunWorkspace, warmup_steps: int, rows: list[int] | None,
                 calibration: Calibration | None, **changes) -> Probe:
    """One plain step of the model of ``workspace`` (open), recorded block by block, then the
    clean steps timed and (without ``calibration``) the calibration runs."""
    family = get_family(workspace.bundle.family.name)
    device = resolve_device(workspace.config.model)
    run, collector = _record(family, device, warmup_steps, workspace, rows, **changes)
    result = run.result
    recorded, clean = result.history[warmup_steps], result.history[warmup_steps + 1:]
    costs = collector.costs()
    # device terms (a sweep cell's): on the CPU the tracker's figures plus what the device holds
    held = recorded["device_peak_bytes"] - recorded["peak_bytes"]
    blocks_end = None if collector.blocks_end_bytes is None else collector.blocks_end_bytes + held
    model = run.bundle.transformer
    frozen = {bl.name: [sum(tensor_bytes(p) for p in block.parameters() if not p.requires_grad)
                        for block in family.blocks(model, bl)] for bl in family.block_lists}
    states = {bl.name: [sum(tensor_bytes(t) for p in block.parameters() if p.requires_grad
                            for t in run.context.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor))
                        for block in family.blocks(model, bl)] for bl in family.block_lists}
    h2d_s_per_byte = copy_seconds_per_byte(device) / 2
    seconds = [r["seconds"] for r in clean]
    validation_peak = result.report["memory"]["validation_peak_bytes"]
    del run, result, model, collector  # its model copy goes before the calibration trains theirs
    key = calibration_key(workspace, warmup_steps) if calibration is None else None
    calibration = calibration or remembered_calibration(key)  # the caller announced as first_probe_steps() said
    if calibration is None:
        schedules = calibration_schedules(family, costs, workspace.config.schedule.streams)
        workspace.expect(calibration_steps(warmup_steps, 1 + len(schedules)) - calibration_steps(warmup_steps))
        calibration = calibrate(workspace, warmup_steps, schedules, costs, sum(sum(b) for b in frozen.values()),
                                h2d_s_per_byte)
        remember_calibration(key, calibration)
        seconds += calibration.plain_seconds  # the plain step timed again, in lockstep with the others
    return Probe(family.name, device.type, costs, max(r["device_peak_bytes"] for r in [recorded, *clean]),
                 statistics.median(seconds), calibration.offload_s_per_tensor,
                 calibration.offload_s_per_byte, blocks_end, validation_peak, frozen,
                 h2d_s_per_byte, states, recorded["start_bytes"] if device.type == "cuda" else held,
                 recompute_s_per_call=calibration.recompute_s_per_call,
                 recompute_s_per_tensor=calibration.recompute_s_per_tensor,
                 stream_s_per_tensor=calibration.stream_s_per_tensor)


def _record(family: FamilyAdapter, device: torch.device, warmup_steps: int, workspace: RunWorkspace,
            rows: list[int] | None, **changes) -> tuple[Any, _Collector]:
    """Run the probe's plain run: warm-up steps, the recorded step (module tracker and saved-tensor
    hook on), then :data:`TIMING_STEPS` clean steps with only the blocks' timing hooks."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run = workspace.start(PLAIN, warmup_steps, 1 + TIMING_STEPS, rows=rows, **changes)
    # the run adds the LoRA to the copy; hooks attach to its blocks, which the run keeps
    collector = _Collector(run.bundle.transformer, family, sync)
    steps = iter(run)
    try:
        for _ in range(warmup_steps):
            next(steps)
        # record the step after the warm-up: the LoRA weights are resident by then; the module
        # tracker and the saved-tensor hook cost time, so they are on for this step only
        collector.active, collector.resident = True, resident_storages(run.context.model)
        collector.memory = run.context.memory
        with collector.modules, torch.autograd.graph.saved_tensors_hooks(collector.pack, lambda t: t):
            next(steps)
        collector.active = False
        for _ in range(TIMING_STEPS):
            collector.next_timing_step()
            next(steps)
        collector.timing = False
        next(steps, None)  # the run ends (its outputs are written)
    finally:
        collector.close()
        steps.close()
    return run, collector
