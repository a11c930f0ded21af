"""Generic fallback: segmented checkpointing for a diffusers model that has no family adapter.

Any diffusers model whose loop calls ``self._gradient_checkpointing_func(block, *args)`` can be
checkpointed per block. :func:`probe_family` derives an adapter from one recorded forward pass:

1. Discovery: a recording checkpoint function sees every block call; calls are grouped by the
   ``nn.ModuleList`` that holds the block (its dotted path is the list's ``attr``).
2. Carry map: for consecutive blocks of a list, an argument of block i+1 that *is* (same tensor
   object) an output of block i is carried; every other argument must be the same object (or
   equal value) for both blocks. A list where that does not hold, or whose blocks are not called
   once each in order, cannot be segmented.
3. Proof: with the inferred carry maps, one forward + backward at interval 2 must give the same
   output and the same gradients as the run without checkpointing (fp32, max abs diff <=
   ``tolerance``), with no runner fallback. Only then are segments allowed; otherwise the
   adapter is per-block only. The adapter's ``plan_notes`` say which, so every plan and report
   of the model states it.

The runner's own safety net (docs/SCHEDULES.md "How the engine hooks into diffusers": detect and
fall back, never compute silently wrong values) still holds during training.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from ..config.schedule import CheckpointSchedule
from ..families.base import BlockList, Carry, FamilyAdapter, TextSpec
from .plan import count_blocks, effective_plan
from .runner import SegmentRunner, same_arguments


@dataclass
class _Call:
    path: str
    index: int
    args: tuple
    kwargs: dict
    output: Any


def _outputs(output: Any) -> list[tuple[int | None, Any]]:
    if isinstance(output, torch.Tensor):
        return [(None, output)]
    if isinstance(output, (tuple, list)):
        return [(i, o) for i, o in enumerate(output) if isinstance(o, torch.Tensor)]
    return []


def _record(model: torch.nn.Module, call: Callable[[], Any]) -> list[_Call]:
    where = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            for i, child in enumerate(module):
                where.setdefault(id(child), (name, i))
    calls: list[_Call] = []

    def recorder(block, *args, **kwargs):
        output = block(*args, **kwargs)
        path, index = where.get(id(block), (None, -1))
        calls.append(_Call(path, index, args, kwargs, output))
        return output

    model.enable_gradient_checkpointing(gradient_checkpointing_func=recorder)
    try:
        with torch.enable_grad():
            call()
    finally:
        model.disable_gradient_checkpointing()
    return calls


def _infer_carry(calls: list[_Call]) -> tuple[Carry | None, str]:
    """The carry map of one list's consecutive calls, or ``None`` and the reason."""
    if [c.index for c in calls] != list(range(calls[0].index, calls[0].index + len(calls))):
        return None, "its blocks are not called once each, in order"
    links: set | None = None
    for a, b in zip(calls, calls[1:]):
        found = set()
        slots = [(i, v) for i, v in enumerate(b.args)] + list(b.kwargs.items())
        outputs = _outputs(a.output)
        for slot, value in slots:
            match = [out_index for out_index, out in outputs if value is out]
            if match:
                found.add((match[0], slot))
            else:
                before = a.args[slot] if isinstance(slot, int) and slot < len(a.args) else a.kwargs.get(slot, None)
                if not same_arguments(before, value):
                    return None, f"argument {slot!r} changes between blocks {a.index} and {b.index}"
        if links is not None and found != links:
            return None, f"the outputs feed other arguments at block {b.index}"
        links = found
    if not links:
        return (Carry(((None, 0),)), "") if len(calls) == 1 else (None, "no output feeds the next block")
    return Carry(tuple(sorted(links, key=lambda link: str(link[1])))), ""


def _first_tensor(output: Any) -> torch.Tensor:
    """The first tensor of a model's output: a tensor, a tuple (``return_dict=False``) or a
    diffusers ``BaseOutput`` / mapping (the models' default, e.g. ``Transformer2DModelOutput``).

    Raises:
        TypeError: the output holds no tensor.
    """
    if isinstance(output, torch.Tensor):
        return output
    items = output.values() if isinstance(output, Mapping) else output
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"model output {type(output).__name__} holds no tensor")


def _loss_and_grads(model, forward: Callable[[], Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        output = _first_tensor(forward())
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(1), dtype=output.dtype)
    (output.float() * weights.to(output.device)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return output.detach(), grads


def probe_family(model: torch.nn.Module, inputs: dict[str, Any], tolerance: float = 1e-6) -> FamilyAdapter:
    """An adapter for ``model`` (any diffusers model), proven on one step with ``inputs``.

    Args:
        model: a diffusers model that supports gradient checkpointing, in fp32 for the proof,
            with the parameters to train set to ``requires_grad`` (e.g. a LoRA already added).
        inputs: keyword arguments of one forward call (the model's own defaults work: a
            ``BaseOutput`` or a tuple).
        tolerance: largest allowed abs difference of outputs and gradients in the proof.

    Returns:
        A :class:`FamilyAdapter` named ``generic:<class>`` (not registered), whose
        ``plan_notes`` state whether segments were proven or why the model is per-block only.
        Its ``make_inputs`` returns ``inputs`` (the caller builds real batches).

    Raises:
        ValueError: the class does not support gradient checkpointing, never calls its
            checkpoint function, or checkpoints a module outside any ``nn.ModuleList``.
    """
    if not getattr(model, "_supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing "
                         "(diffusers' _supports_gradient_checkpointing is False): nothing to wire")
    calls = _record(model, lambda: model(**inputs))
    groups: dict[str, list[_Call]] = {}
    for call in calls:
        if call.path is None:
            raise ValueError(f"{type(model).__name__} checkpoints a module that is not in an nn.ModuleList: "
                             "the generic fallback cannot name its block list")
        groups.setdefault(call.path, []).append(call)
    if not groups:
        raise ValueError(f"{type(model).__name__} never calls its gradient-checkpointing function: "
                         "there is no block to checkpoint")
    lists, reasons = [], []
    for path, group in groups.items():
        carry, reason = _infer_carry(group)
        if carry is None:
            reasons.append(f"list {path!r}: {reason}")
            carry = Carry(((None, 0),))
        lists.append(BlockList(path.replace(".", "_"), path, carry))
    adapter = FamilyAdapter(
        name=f"generic:{type(model).__name__}", model_class=type(model).__name__, block_lists=tuple(lists),
        text=lambda cfg: TextSpec(1), make_inputs=lambda *a: inputs, read_output=lambda m, out, x: _first_tensor(out),
        tiny_config={}, latent_channels=0, segmented=not reasons)
    if not reasons:
        reasons = _prove(model, adapter, inputs, tolerance)
    if reasons:
        note = ("generic fallback: per-block checkpointing only (" + "; ".join(reasons) + ")")
        return replace(adapter, segmented=False, plan_notes=(note,), notes=(note,))
    note = ("generic fallback: segments proven by a one-step probe (outputs and gradients equal to the "
            f"run without checkpointing within {tolerance:g})")
    return replace(adapter, plan_notes=(note,), notes=(note,))


def _prove(model, adapter: FamilyAdapter, inputs: dict[str, Any], tolerance: float) -> list[str]:
    """Reasons the adapter's segments are not proven on ``inputs`` (empty list = proven)."""
    reference_out, reference = _loss_and_grads(model, lambda: model(**inputs))
    if not reference:
        return ["no parameter requires grad, so the probe cannot compare gradients"]
    schedule = CheckpointSchedule(gradient_checkpointing_interval=2)
    plan = effective_plan(adapter, schedule, count_blocks(adapter, model), warn=False)
    runner = SegmentRunner(model, adapter, plan).install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fallback is reported below as the reason
            out, grads = _loss_and_grads(model, lambda: runner.forward(**inputs))
    finally:
        model.disable_gradient_checkpointing()
        runner.close()
    if runner.stats.fallbacks:
        return [f"the probe fell back: {runner.stats.fallbacks[0]}"]
    if grads.keys() != reference.keys():
        return ["the probe's segments did not reach every trainable parameter"]
    worst = max([(out - reference_out).abs().max().item()] +
                [(grads[k] - reference[k]).abs().max().item() for k in reference])
    if worst > tolerance:
        return [f"the probe's segments differ from the run without checkpointing (max abs diff {worst:.3g})"]
    return []
