"""The declarative family adapter: what the segment runner and the trainer need to know of a model.

A family file declares; it does not execute (SPEC.md "A sketch of the house"): its diffusers class,
its block lists with their carry maps and FFN/attention boundaries, its capabilities, how a
training batch becomes the model's keyword arguments, and a tiny preset config for tests and the
demo. It registers itself with one call to :func:`register_family`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

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

    Source: SPEC.md "How the engine hooks into diffusers".
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


@dataclass(frozen=True)
class TextSpec:
    """Shapes of the text conditioning a family expects.

    Attributes:
        seq_dim: width D of the per-token embeddings ``(B, L, D)``.
        pooled_dim: width P of the pooled embedding ``(B, P)``, or ``None`` when not used.
        max_length: number of tokens L the default embedder pads/truncates to.
    """

    seq_dim: int
    pooled_dim: int | None = None
    max_length: int = 16


@dataclass(frozen=True)
class TextBatch:
    """Text conditioning of one batch.

    Attributes:
        seq: per-token embeddings, ``(B, L, D)``.
        mask: token mask, ``(B, L)`` bool, True for real tokens.
        pooled: pooled embedding ``(B, P)`` or ``None``.
    """

    seq: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "TextBatch":
        """The same batch on ``device`` (floating tensors cast to ``dtype`` when given)."""
        pooled = None if self.pooled is None else self.pooled.to(device, dtype)
        return TextBatch(self.seq.to(device, dtype), self.mask.to(device), pooled)


MakeInputs = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, TextBatch], dict]
"""``(model, noisy latents (B, C, H, W) or (B, C, F, H, W), sigmas (B,) in [0, 1], text) -> kwargs``."""
ReadOutput = Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor]
"""``(model, model output, noisy latents) -> prediction with the latents' shape``."""


@dataclass(frozen=True)
class FamilyAdapter:
    """Everything the engine knows of one model family; data plus two small calling functions.

    Attributes:
        name: family name used on the command line (``flux``, ``sd3``, ...).
        model_class: the diffusers class name (``FluxTransformer2DModel``).
        block_lists: the model's block lists, in forward order.
        text: the text conditioning's shapes, a function of the model config.
        make_inputs: builds the model's forward keyword arguments.
        read_output: turns the model output into a prediction shaped like the latents.
        tiny_config: config of the tiny random-init preset (tests and the demo).
        latent_channels: channels C of the VAE latents the model consumes.
        video_latents: the model takes ``(B, C, F, H, W)`` latents (a single frame for images).
        objective: ``flow`` (rectified flow: predict ``noise - x0``) or ``epsilon``.
        segmented: the family supports interval/stride (whole-block segments); when ``False``
            the interval and stride are ignored with a warning and every block is per-block.
        stride_honoured: the family honours the stride.
        shared_sigma: the model takes one timestep per batch, not per sample (MiniMax H3): the
            trainer draws one noise level per micro-batch.
        lora_targets: default LoRA target module names (attention projections).
        notes: free-text notes shown in the support table.
        plan_notes: notes every plan of this family carries (the generic fallback says there
            whether its segments were proven by the probe).
    """

    name: str
    model_class: str
    block_lists: tuple[BlockList, ...]
    text: Callable[[Mapping[str, Any]], TextSpec]
    make_inputs: MakeInputs
    read_output: ReadOutput
    tiny_config: Mapping[str, Any]
    latent_channels: int
    video_latents: bool = False
    objective: str = "flow"
    segmented: bool = True
    stride_honoured: bool = True
    shared_sigma: bool = False
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    notes: tuple[str, ...] = field(default=())
    plan_notes: tuple[str, ...] = field(default=())

    def blocks(self, model: torch.nn.Module, block_list: BlockList) -> torch.nn.ModuleList:
        """The blocks of ``block_list`` in ``model``: the ``nn.ModuleList`` named by
        :attr:`BlockList.attr`, or the modules its path names (see :func:`resolve_blocks`)."""
        plain = getattr(model, block_list.attr, None) if "." not in block_list.attr else None
        if isinstance(plain, torch.nn.ModuleList):
            return plain
        return torch.nn.ModuleList(resolve_blocks(model, block_list.attr))

    def model_cls(self) -> type:
        """The diffusers model class."""
        import diffusers
        import diffusers.models

        cls = getattr(diffusers, self.model_class, None) or getattr(diffusers.models, self.model_class, None)
        if cls is None:
            raise ImportError(f"diffusers {diffusers.__version__} has no class {self.model_class}")
        return cls


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


_REGISTRY: dict[str, FamilyAdapter] = {}


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Register ``adapter`` under its name (one explicit call per family file).

    Raises:
        ValueError: a different adapter is already registered under that name.
    """
    existing = _REGISTRY.get(adapter.name)
    if existing is not None and existing is not adapter:
        raise ValueError(f"family {adapter.name!r} is already registered")
    _REGISTRY[adapter.name] = adapter
    return adapter


def get_family(name: str) -> FamilyAdapter:
    """The adapter registered as ``name`` (case-insensitive).

    Raises:
        KeyError: unknown family; the message lists the known ones.
    """
    key = name.lower()
    if key not in _REGISTRY:
        raise KeyError(f"family={name!r} is unknown: allowed {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


def family_names() -> list[str]:
    """Names of all registered families, sorted."""
    return sorted(_REGISTRY)


def family_for_class(class_name: str) -> FamilyAdapter | None:
    """The adapter whose diffusers class is ``class_name``, if any."""
    for adapter in _REGISTRY.values():
        if adapter.model_class == class_name:
            return adapter
    return None
