"""Block lists and carry maps: which modules of a model are scheduled, and how they chain.

A :class:`BlockList` names one ``nn.ModuleList`` (or a dotted path to nested blocks, see
:func:`resolve_blocks`) and its :class:`Carry`, the map from one block's outputs to the next
block's arguments. Source: docs/SCHEDULES.md "How the engine hooks into diffusers".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .lazy import torch

OutputIndex = int | None
"""Position in a block's returned tuple, or ``None`` when the block returns one tensor."""
ArgSlot = int | str
"""Position of a block's positional argument, or the name of a keyword argument."""


@dataclass(frozen=True)
class Carry:
    """How one block's outputs become the next block's arguments (the "carry map").

    Attributes:
        links: pairs ``(output index, argument slot)``. Flux's double blocks are called as
            ``block(hidden, encoder, temb, rope, kwargs)`` and return ``(encoder, hidden)``, so
            their carry is ``((0, 1), (1, 0))``; Wan blocks return one tensor fed to argument 0:
            ``((None, 0),)``. Arguments without a link are the same for every block of the list.

    Source: docs/SCHEDULES.md "How the engine hooks into diffusers".
    """

    links: tuple[tuple[OutputIndex, ArgSlot], ...]

    def apply(self, output: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments of the next block: ``args``/``kwargs`` with carried slots replaced by ``output``."""
        new_args, new_kwargs = list(args), dict(kwargs)
        for out_index, slot in self.links:
            value = output if out_index is None else output[out_index]
            if isinstance(slot, str):
                new_kwargs[slot] = value
            else:
                new_args[slot] = value
        return tuple(new_args), new_kwargs

    def carried_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The arguments a block receives in carried slots (its hidden states), e.g. for offload."""
        return [kwargs.get(slot) if isinstance(slot, str) else args[slot] for _, slot in self.links]


SINGLE = Carry(((None, 0),))
"""Carry of blocks that take the hidden state first and return it alone (Wan, PixArt, Sana, ...)."""


@dataclass(frozen=True)
class BlockList:
    """One block list of a model, scheduled on its own.

    Attributes:
        name: short name used in plans and reports (``double``, ``single``, ``blocks``, ...).
        attr: the model attribute holding the ``nn.ModuleList``, or a dotted path to the blocks
            (``"text_fusion.refiner_blocks"``, ``"down_blocks.*.resnets"``, ``"mid_block.resnets[1:]"``;
            see :func:`resolve_blocks`).
        carry: the list's :class:`Carry`.
        ffn: attribute path of the feed-forward sub-module inside a block (``"ff"``), or a
            tuple of sibling sub-modules the block calls as a chain on one tensor (Flux's single
            blocks: ``("proj_mlp", "act_mlp")`` for ``act_mlp(proj_mlp(x))``), or ``None`` when
            the block has no clean FFN boundary (then ``*-ffn`` backends fail for its list).
        attention: attribute path of the attention sub-module, or ``None``.
        routed: ``False`` when the model's loop calls these blocks directly, never through the
            checkpoint function (then no schedule can apply to them; the plan says so).
    """

    name: str
    attr: str
    carry: Carry = SINGLE
    ffn: str | tuple[str, ...] | None = None
    attention: str | None = None
    routed: bool = True


_PART = re.compile(r"(\*|\w+)(?:\[(-?\d*):(-?\d*)\])?")


def resolve_blocks(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """The modules at dotted ``path`` under ``model``, flattened in order.

    Each part is an attribute name (skipped for modules that lack it or hold ``None``) or ``*``
    (every child), optionally followed by a slice ``[a:b]`` of the ``nn.ModuleList`` elements it
    names; an ``nn.ModuleList`` left at the end is expanded into its elements.
    ``"down_blocks.*.resnets"`` -> every resnet of every down block.
    """
    current: list[torch.nn.Module] = [model]
    for part in path.split("."):
        match = _PART.fullmatch(part)
        if match is None:
            raise ValueError(f"block path {path!r}: bad part {part!r}")
        name, start, stop = match.groups()
        found: list[torch.nn.Module] = []
        for module in current:
            if name == "*":
                items = list(module.children())
            else:
                child = getattr(module, name, None)
                if child is None:
                    continue
                items = [child]
            if start is not None:  # a slice was given (its bounds may be empty strings)
                elements = [e for i in items for e in (i if isinstance(i, torch.nn.ModuleList) else [i])]
                items = elements[slice(int(start) if start else None, int(stop) if stop else None)]
            found.extend(items)
        current = found
    out: list[torch.nn.Module] = []
    for module in current:
        out.extend(module if isinstance(module, torch.nn.ModuleList) else [module])
    return out
