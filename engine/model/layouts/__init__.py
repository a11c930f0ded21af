"""The original release layouts of the families' transformers, both ways, and where each diffusers
weight's rows sit in them.

ComfyUI builds most models in the layout their authors released (Black Forest Labs' Flux,
Stability AI's MMDiT, Wan-AI's Wan, ...) and maps a LoRA's keys to those weights
(``comfy/lora.py`` ``model_lora_keys_unet``: ``diffusion_model.<original key>`` and
``lora_unet_<original key with underscores>``); diffusers converts the same files into its own
layout (``SINGLE_FILE_LOADABLE_CLASSES``' ``checkpoint_mapping_fn``). Each family here is an
:class:`OriginalLayout`: ``from_original`` is diffusers' conversion (or, where diffusers hard-codes
the released width, a thin wrapper that gives it the sizes read from the tensors), and
``to_original`` its inverse, built from the renames read out of diffusers' function
(:mod:`.renames`) plus the fused tensors it splits. ``tests/model/test_layouts.py`` checks
``from_original(to_original(sd)) == sd`` for every family, tensor by tensor.

``to_original`` works row-wise: it renames keys and joins, splits or reorders tensors along dim 0
only, reading sizes from dim 0. So :func:`row_map` can run it on one column per weight and learn,
for every diffusers weight, the original weight and rows it lands in (a fused ``qkv`` holds the
rows of ``to_q``, ``to_k`` and ``to_v``): what :mod:`..comfy_lora` needs to write one exact LoRA
per original weight.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

from ...families.comfyui import LAYOUT_MODULES
from .renames import LayoutError

StateDict = dict[str, torch.Tensor]

_MODULES = LAYOUT_MODULES
_LAYOUTS: dict[str, "OriginalLayout"] = {}


@dataclass(frozen=True)
class OriginalLayout:
    """One family's released layout.

    Attributes:
        family: the family name.
        to_original: diffusers-layout state dict -> released layout (row-wise, see the module
            docstring; consumes nothing: returns a new dict).
        from_original: released layout -> diffusers layout (diffusers' conversion; may consume
            its input); ``from_original(checkpoint, config)`` when ``needs_config``.
        lora_prefix: how ComfyUI names a LoRA of weight ``<key>.weight``: ``diffusion_model.``
            (``diffusion_model.<key>``) or ``lora_unet_`` (kohya: ``lora_unet_<key with _>``).
        source: where the released layout and the conversion come from (for docs and messages).
        needs_config: ``from_original`` also takes the diffusers config of the model it converts
            for (diffusers' UNet conversion reads ``layers_per_block`` from it, not from the keys);
            a file is then converted once per candidate config.
    """

    family: str
    to_original: Callable[[StateDict], StateDict]
    from_original: Callable[..., StateDict]
    source: str
    lora_prefix: str = "diffusion_model."
    needs_config: bool = False


def register_layout(layout: OriginalLayout) -> OriginalLayout:
    """Add ``layout`` to the registry (each family's module calls this at import)."""
    _LAYOUTS[layout.family] = layout
    return layout


def layout_families() -> tuple[str, ...]:
    """The families with a released layout known here (sorted)."""
    return tuple(sorted(_MODULES))


def get_layout(family: str) -> OriginalLayout | None:
    """The :class:`OriginalLayout` of ``family`` (its module imported on first use), or ``None``."""
    if family not in _MODULES:
        return None
    if family not in _LAYOUTS:
        importlib.import_module(f"{__name__}.{_MODULES[family]}")
    return _LAYOUTS[family]


def diffusers_converter(model_class: str) -> Callable[[StateDict], StateDict]:
    """diffusers' own single-file conversion of ``model_class`` (``checkpoint_mapping_fn``)."""
    mapping = SINGLE_FILE_LOADABLE_CLASSES[model_class]["checkpoint_mapping_fn"]
    return lambda checkpoint: mapping(checkpoint=checkpoint, config={})


@dataclass(frozen=True)
class Rows:
    """Where a diffusers weight sits in the released layout.

    Attributes:
        key: the original weight's key (``double_blocks.0.img_attn.qkv.weight``).
        rows: ``(out,)`` int64 indices: row ``i`` of the diffusers weight is row ``rows[i]`` of
            the original one.
        total: the original weight's number of rows.
        ndim: the original weight's number of dimensions (a conv's 4 where diffusers' Linear has 2).
    """

    key: str
    rows: torch.Tensor
    total: int
    ndim: int = 2


def row_map(layout: OriginalLayout, shapes: Mapping[str, tuple[int, ...]],
            only: Iterable[str] | None = None, strict: bool = True) -> dict[str, Rows]:
    """For the diffusers weights ``only`` (default: all) of ``shapes`` (``{key: shape}``, the
    diffusers layout), the original weight and rows each becomes under ``layout.to_original``.

    Runs ``to_original`` on a probe of one column per tensor (row ``i`` of tensor ``n`` holds a
    number unique to ``(n, i)``), so it costs the rows only, at any model size.

    Args:
        strict: a weight of ``only`` that is not wholly in one original weight raises; with
            False it is left out of the result.

    Raises:
        LayoutError: ``to_original`` fails on the probe; with ``strict``, a weight of ``only`` is
            missing from the released layout, lands in two original weights or loses rows.
    """
    keys = list(shapes)
    sizes = [shapes[k][0] if shapes[k] else 1 for k in keys]
    starts = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)
    probe = {}
    for n, key in enumerate(keys):
        ids = torch.arange(int(starts[n]), int(starts[n + 1]), dtype=torch.float64)
        shape = shapes[key]
        probe[key] = ids.reshape((sizes[n],) + (1,) * (len(shape) - 1)) if shape else ids.reshape(())
    try:
        original = layout.to_original(probe)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise LayoutError(f"{layout.family}: the released layout cannot be built from these weights: {exc}") from exc
    wanted = {keys.index(k): k for k in (only if only is not None else keys)}
    parts: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for okey, tensor in original.items():
        ids = (tensor.reshape(tensor.shape[0], -1)[:, 0] if tensor.dim() else tensor.reshape(1)).to(torch.int64)
        owner = torch.searchsorted(starts, ids, right=True) - 1
        for n in owner.unique().tolist():
            if n in wanted:
                at = (owner == n).nonzero().flatten()
                parts.setdefault(wanted[n], []).append((okey, ids[at] - starts[n], at))
    out = {}
    for key in wanted.values():
        found = parts.get(key, [])
        whole = len(found) == 1 and len(found[0][1]) == (shapes[key][0] if shapes[key] else 1)
        if not strict and not whole:
            continue
        if len(found) != 1:
            raise LayoutError(f"{layout.family}: {key} is {'split over ' if found else 'missing from'} the released "
                              f"layout{' ' + str(sorted(f[0] for f in found)) if found else ''}")
        okey, rows, at = found[0]
        if len(rows) != (shapes[key][0] if shapes[key] else 1):
            raise LayoutError(f"{layout.family}: {key} keeps {len(rows)} of its rows in the released layout")
        placed = torch.empty(len(rows), dtype=torch.int64)
        placed[rows] = at
        total = int(original[okey].shape[0]) if original[okey].dim() else 1
        out[key] = Rows(okey, placed, total, original[okey].dim())
    return out


__all__ = ["LayoutError", "OriginalLayout", "Rows", "diffusers_converter", "get_layout", "layout_families",
           "register_layout", "row_map"]
