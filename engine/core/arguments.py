"""The arguments of a block call as the segment runner keeps and compares them: the tensors in a
block's output, a copy of a call's containers (:func:`_snapshot`), and the carry check's equality
(:func:`same_arguments`). See ``engine/core/runner.py`` "Safety net"."""

from __future__ import annotations

from typing import Any

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a block's output (tuples, lists and dicts walked)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _snapshot(value: Any) -> Any:
    """A copy of the containers (tuples, lists, dicts) of a call's arguments; tensors and other
    objects are shared. A model's loop may rewrite an entry of a dict it hands to every block
    (diffusers' Flux.2 KV-cache mode does, before each block): a checkpoint call that kept the dict
    itself would recompute with the entry of a later block, and the segment check below would
    compare the changed dict with itself. A tuple holding no container is immutable all the way
    down and is kept as it is (the common case: tensors, ``None``, a rotary-embedding pair), which
    keeps the per-call cost low (bench/overhead.py)."""
    kind = type(value)
    if kind is tuple and _frozen(value):  # the common case, decided on exact types
        return value
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields") and any(_holds_mutable(v) for v in value):
        return tuple(_snapshot(v) for v in value)
    return value


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str})
"""Exact types of arguments that hold no container (a tensor subclass goes the general way)."""


def _frozen(value: tuple) -> bool:
    """Whether a plain tuple holds only :data:`_PLAIN` values and such tuples (nothing to copy)."""
    for v in value:
        kind = type(v)
        if kind not in _PLAIN and not (kind is tuple and _frozen(v)):
            return False
    return True


def _holds_mutable(value: Any) -> bool:
    """Whether ``value`` is or holds (through tuples) a list or dict."""
    if isinstance(value, (list, dict)):
        return True
    return isinstance(value, tuple) and any(_holds_mutable(v) for v in value)


def same_arguments(a: Any, b: Any) -> bool:
    """Whether two block-call arguments are the same: tensors by identity, containers element-wise,
    everything else by ``==`` (identity where ``==`` is not a bool)."""
    if a is b:  # the loop passed the very object (a tensor, or the segment's own tuple): nothing to compare
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_arguments(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_arguments(a[k], b[k]) for k in a)
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool (arrays, ...): only identity counts
        return False
