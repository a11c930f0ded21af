"""The engine's messages as a ComfyUI user reads them: options named by the node inputs that set
them, never by the command line's flags.

The engine writes for ``segckpt`` (``resume with --resume``); every option's flag, key and
allowed values are declared once, in its metadata (``engine/config/options.py``), and the nodes
that show an option name their input (:class:`~.widgets.NodeOptions` registers it here). So one
rule renders any message: a declared flag becomes ``<input>`` (``<input>=true`` for a switch,
``<input>=false`` for a ``--no-...`` switch, ``<input>=<value>`` when an allowed value follows it),
and an option key a node shows under another name becomes that name (``validation_every`` ->
``preview_every``). Flags that are no option (``torchrun --nproc-per-node``) stay as they are.
"""

from __future__ import annotations

import functools
import re
from typing import Mapping

from ..engine import api

_INPUTS: dict[str, str] = {}
"""Option key -> the node input that sets it (the first node that registered it)."""

_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:(=| )(?!-)('[^']*'|[^\s,;()'\"]+))?")


def register(names: Mapping[str, str]) -> None:
    """Name option keys by node inputs: ``names`` maps a node's input name to its option key."""
    for name, key in names.items():
        _INPUTS.setdefault(key, name)
    _renamed.cache_clear()


def input_name(key: str) -> str:
    """The node input that sets option ``key`` (the key itself when no node shows it)."""
    return _INPUTS.get(key, key)


@functools.lru_cache(maxsize=1)
def _renamed() -> re.Pattern | None:
    """Keys the nodes show under other names: as ``key=`` always, bare only when the key holds an
    underscore (``output`` is a folder's name too)."""
    keys = [k for k, name in _INPUTS.items() if k != name]
    if not keys:
        return None
    alternatives = "|".join(sorted(map(re.escape, keys), key=len, reverse=True))
    return re.compile(rf"(?<![\w/.-])({alternatives})(?=[^\w/.-]|$)")


def _flags() -> dict[str, api.Option]:
    return {opt.cli: opt for opt in api.OPTIONS if opt.cli}


def _value(opt: api.Option, token: str, sep: str) -> str | None:
    """``token`` when it reads as a value of ``opt`` (one of its choices, a number; for a string
    option a quoted string or anything after ``=``), else None."""
    bare = token.rstrip(".")
    if opt.choices is not None:
        return bare if bare in map(str, opt.choices) else None
    if opt.type in (int, float):
        try:
            float(bare)
        except ValueError:
            return None
        return bare
    return token if opt.type is str and (sep == "=" or token.startswith("'")) else None


def node_words(text: str) -> str:
    """``text`` with the command line's option flags and keys as the nodes name them.

    >>> node_words("state saved, resume with --resume")   # doctest: +SKIP
    'state saved, resume with resume=true'
    """
    flags = _flags()

    def flag(match: re.Match) -> str:
        opt = flags.get(match.group(1))
        if opt is None:
            return match.group(0)
        name, sep, token = input_name(opt.key), match.group(2), match.group(3)
        if opt.type is bool:
            shown = f"{name}={'false' if opt.cli.startswith('--no-') else 'true'}"
            return shown + (f"{sep}{token}" if token else "")
        value = _value(opt, token, sep) if token else None
        if value is None:
            return name + (f"{sep}{token}" if token else "")
        return f"{name}={value}" + token[len(value):]

    text = _FLAG.sub(flag, text)
    pattern = _renamed()
    if pattern is None:
        return text
    return pattern.sub(lambda m: _INPUTS[m.group(1)] if "_" in m.group(1) or m.string[m.end():m.end() + 1] == "="
                       else m.group(1), text)
