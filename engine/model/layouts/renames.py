"""Renames read from diffusers' own single-file conversion functions, and their inverse.

Most of diffusers' conversions (``diffusers/loaders/single_file_utils.py``) rename keys with a
dict literal of ``{original fragment: diffusers fragment}`` applied in order with ``str.replace``
(``TRANSFORMER_KEYS_RENAME_DICT`` in ``convert_wan_transformer_to_diffusers``, ...). The dict is
a local of the function, so it is read from the function's source (:func:`diffusers_renames`) rather
than copied here. The inverse of such a chain is not a chain of reversed replacements (two
fragments may map to one: Wan's ``head.modulation`` and ``modulation`` both become
``scale_shift_table``), so :func:`inverse_rename` searches: every string reachable from the
diffusers key by undoing replacements, kept when the forward chain maps it back, and of those the
ones no further undoing leads on from, and of those the ones the most specific renames explain (the
longest diffusers fragments); a family resolves what stays ambiguous by a rule of its own.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Callable, Mapping, Sequence

import torch

Pairs = tuple[tuple[str, str], ...]


class LayoutError(ValueError):
    """A key the mapping between layouts cannot place (named, with the candidates seen)."""


@functools.cache
def diffusers_renames(function: Callable, name: str) -> Pairs:
    """The ``(original, diffusers)`` pairs of the dict literal assigned to ``name`` in ``function``'s source.

    Raises:
        LayoutError: no such assignment, or its value is not a literal dict of strings (the
            diffusers version changed the function: the message names both).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as exc:
                raise LayoutError(f"{function.__name__}.{name} is not a literal dict") from exc
            if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                return tuple(value.items())
    raise LayoutError(f"diffusers' {function.__name__} assigns no literal dict {name}")


def forward_rename(key: str, pairs: Pairs) -> str:
    """``key`` through the chain: each ``str.replace(original, diffusers)`` in order, as diffusers does."""
    for old, new in pairs:
        key = key.replace(old, new)
    return key


def inverse_rename(key: str, pairs: Pairs, resolve: Mapping[str, str] | None = None, depth: int = 6) -> str:
    """The original key that :func:`forward_rename` maps to the diffusers key ``key``.

    Args:
        key: a diffusers key (``blocks.0.attn1.to_q.weight``).
        pairs: the chain (:func:`diffusers_renames`).
        resolve: ``{regex: replacement}`` the family uses where the search leaves several
            originals (the first pattern that matches ``key`` gives the answer, ``re.sub`` style).
        depth: how many replacements are undone at most.

    Raises:
        LayoutError: no original maps to ``key``, or several do and no rule of ``resolve`` applies.
    """
    for pattern, replacement in (resolve or {}).items():
        if re.search(pattern, key):
            return re.sub(pattern, replacement, key)
    valid = {s for s in _undone(key, pairs, depth) if forward_rename(s, pairs) == key}
    final = [s for s in valid if not (_undone(s, pairs, depth) - {s}) & valid]
    if len(final) > 1:  # the most specific renames win: the longest diffusers fragments undone
        best = max(_specificity(s, pairs) for s in final)
        final = [s for s in final if _specificity(s, pairs) == best]
    final.sort()
    if len(final) != 1:
        raise LayoutError(f"diffusers key {key!r}: {'no' if not final else 'several'} original keys map to it "
                          f"({', '.join(final) or 'none'})")
    return final[0]


def _specificity(key: str, pairs: Pairs) -> int:
    """Characters of diffusers fragments the forward chain writes into ``key``."""
    total = 0
    for old, new in pairs:
        if old in key:
            total += len(new)
            key = key.replace(old, new)
    return total


def _undone(key: str, pairs: Pairs, depth: int) -> set[str]:
    """``key`` and every string reached from it by undoing up to ``depth`` replacements."""
    seen, frontier = {key}, {key}
    for _ in range(depth):
        frontier = {s.replace(new, old) for s in frontier for old, new in pairs if new in s} - seen
        seen |= frontier
    return seen


def rename_all(state: dict, pairs: Pairs, resolve: Mapping[str, str] | None = None,
               skip: Sequence[str] = ()) -> dict:
    """Every key of ``state`` not starting with a prefix in ``skip`` renamed by :func:`inverse_rename`;
    the others left as they are. Returns a new dict."""
    return {(k if k.startswith(tuple(skip)) else inverse_rename(k, pairs, resolve)): v for k, v in state.items()}


def join_rows(state: dict, parts: Sequence[str], into: str) -> dict:
    """Every module with the sub-modules ``parts`` (``to_q``, ``to_k``, ``to_v``) gets one
    ``<module>.<into>`` weight (and bias) with their rows joined in that order (dim 0), as the
    released layouts store fused projections; the parts are removed. Returns a new dict."""
    out = dict(state)
    first = f".{parts[0]}."
    for key in [k for k in state if first in k]:
        head, _, param = key.rpartition(first)
        if "." in param or key not in out:
            continue
        names = [f"{head}.{p}.{param}" for p in parts]
        if all(n in out for n in names):
            out[f"{head}.{into}.{param}"] = torch.cat([out.pop(n) for n in names])
    return out
