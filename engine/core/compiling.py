"""Per-block ``torch.compile`` (``compile_blocks``): each block of the family's lists compiled once,
the checkpoint call outside the compiled block (the segment runner calls the compiled block inside
its region), dynamic shapes so that buckets and frame counts do not recompile.

How: diffusers' ``ModelMixin.compile_repeated_blocks`` where the model declares ``_repeated_blocks``
and every block can compile (it calls ``module.compile`` on each of those blocks), else
``module.compile(dynamic=True)`` per block (regional compilation: one graph per block class, reused
by every instance). Measured gains and losses differ by model and card (OneTrainer #1114,
musubi-tuner PR #722, and regressions with RamTorch): the sweep measures it.

A block stays eager, named with why in one warning, where compiling it cannot work as planned:
its forward (or a sub-module's) is swapped for each call (the ``*-ffn`` backends' FFN region,
attention offload), weight streaming moves its parameters between calls, a quantized base's
weights are tensor subclasses, or its region keeps attention outputs (the selective policy must
see the attention kernels, which a compiled block hides inside one operator).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from ..families.base import FamilyAdapter
from ..families.lazy import lazy_imports
from .plan import ScheduleWarning


@dataclass
class CompileReport:
    """What ``compile_blocks`` compiled (``report.json`` ``compile``).

    Attributes:
        how: ``compile_repeated_blocks`` or ``per block``.
        compiled: per block list, the block indices compiled.
        eager: per block list, ``{index: why}`` of the blocks left eager.
        graphs, seconds: graphs dynamo had compiled in this process (:func:`compiled_graphs`) and
            its compile seconds (:func:`compile_seconds`) when compiling was set up; the run
            counts its own from them.
    """

    how: str
    compiled: dict[str, list[int]] = field(default_factory=dict)
    eager: dict[str, dict[int, str]] = field(default_factory=dict)
    graphs: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"how": self.how, "compiled_blocks": {k: len(v) for k, v in self.compiled.items()},
                "eager_blocks": {k: {str(i): why for i, why in v.items()} for k, v in self.eager.items() if v}}

    def section(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """``report.json`` ``compile``: what was compiled, the graphs after the first step and the
        graphs compiled after it, the graphs compiled once every latent shape of the run had trained
        (``recompiles_after_every_shape``), and the seconds spent compiling (kept out of sec/step by
        the warm-up steps).

        Args:
            history: the run's step records (``compiled_graphs``, ``shape``).
        """
        graphs = [h.get("compiled_graphs", 0) for h in history]
        shapes = [h.get("shape", "") for h in history]
        every = next((i for i in range(len(shapes)) if set(shapes[: i + 1]) == set(shapes)), 0)
        return {**self.to_dict(), "graphs_after_first_step": graphs[0] if graphs else 0,
                "recompiles_after_first_step": graphs[-1] - graphs[0] if graphs else 0,
                "latent_shapes": len(set(shapes)),
                "recompiles_after_every_shape": graphs[-1] - graphs[every] if graphs else 0,
                "compile_seconds": round(compile_seconds() - self.seconds, 3)}


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (``torch._dynamo.utils.counters``): a recompile
    adds one."""
    with lazy_imports():
        from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Seconds dynamo and inductor spent compiling in this process so far."""
    with lazy_imports():
        from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def _eager_reason(runner: Any, list_index: int, block_index: int, quantized: bool) -> str | None:
    plan = runner.plan.lists[list_index]
    checkpointed = block_index in set(plan.checkpointed)
    schedule = runner.plan.schedule
    if quantized:
        return "quantized base weights (tensor subclasses)"
    if block_index in set(plan.streamed):
        return "weight streaming moves its weights between calls"
    if checkpointed and runner.ffn_scope:
        return "the FFN region swaps its feed-forward per call (*-ffn backend)"
    if checkpointed and runner.saving is not None:
        return "its region keeps attention outputs (the policy must see the attention kernels)"
    if not (checkpointed and not runner.ffn_scope) and schedule.gradient_checkpointing_offload_attention:
        return "attention offload swaps its attention forward per call"
    return None


def compile_blocks(model: torch.nn.Module, family: FamilyAdapter, runner: Any, quantized: bool = False
                   ) -> CompileReport:
    """Compile the blocks of ``family``'s lists in ``model`` (see the module docstring); the
    compilation itself happens at their first call.

    Args:
        runner: the installed :class:`~.runner.SegmentRunner` (its plan says how each block runs).
        quantized: the frozen base is quantized (torchao / GGUF tensor subclasses).

    Warns:
        ScheduleWarning: once, naming the blocks left eager and why.
    """
    # dynamo's duck shaping gives dimensions of equal size one symbol: on a model whose text and
    # image token counts (or a token count and a width) happen to be equal, one gets specialized with
    # the other and a new bucket recompiles; sizes are kept apart (a process-wide setting)
    fx_config.use_duck_shape = False
    lists = [family.blocks(model, bl) for bl in family.block_lists]
    eager = {bl.name: {} for bl in family.block_lists}
    for li, (bl, blocks) in enumerate(zip(family.block_lists, lists)):
        for bi in range(len(blocks)):
            why = _eager_reason(runner, li, bi, quantized)
            if why is not None:
                eager[bl.name][bi] = why
    repeated = getattr(model, "_repeated_blocks", None)
    every = not any(eager.values())
    report = CompileReport("compile_repeated_blocks" if repeated and every else "per block", graphs=compiled_graphs(),
                           seconds=compile_seconds())
    if repeated and every:
        model.compile_repeated_blocks(dynamic=True)
    for bl, blocks in zip(family.block_lists, lists):
        report.compiled[bl.name] = [i for i in range(len(blocks)) if i not in eager[bl.name]]
        if not (repeated and every):
            for i in report.compiled[bl.name]:
                blocks[i].compile(dynamic=True)
    left = [f"{name} {_ranges(sorted(v))} ({'; '.join(sorted(set(v.values())))})" for name, v in eager.items() if v]
    if left:
        warnings.warn(f"compile_blocks: blocks left eager: {'; '.join(left)}", ScheduleWarning, stacklevel=3)
    return report




def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ", ".join(parts)
