"""Node inputs generated from the engine's option metadata (``engine/config/``), and the config a
node's widget values make.

A widget is declared once, in the option's field: its V3 input (``io.Int``, ``io.Float``,
``io.Boolean``, ``io.String`` or an ``io.Combo`` of its choices), default, bounds, step and tooltip
come from there, so a node, the CLI and
docs/OPTIONS.md say the same thing and accept the same values. A node names each of its widgets' option
keys (``NodeOptions``); its ``validate_inputs`` builds the engine config from the values, so the
config's own validator refuses what the engine would refuse, before the prompt runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..engine import api
from . import messages
from .environment import node_error
from .v3 import io

_TYPES = {bool: io.Boolean, int: io.Int, float: io.Float, str: io.String, tuple: io.String}
_MISSING = object()


def widget(key: str, name: str | None = None, *, optional: bool = False, default: Any = _MISSING,
           tooltip: str | None = None, extra: str = "", zero_unset: bool = False,
           options: tuple[api.Option, ...] = api.OPTIONS) -> io.Input:
    """The V3 input of option ``key``: its type (a combo of its choices), default, min, max, step, tooltip.

    Args:
        name: the node's input name (default: ``key``). optional: an optional input.
        default: the node's default when it differs from the engine's (the Offload node's backend).
        tooltip: the node's own text instead of the option's help; extra: appended to it.
        zero_unset: an optional integer shown as 0 when unset (the schedule's interval and stride).
        options: where the option is declared (the run's options).
    """
    opt = api.option_named(key, options)
    value = opt.default if default is _MISSING else default
    spec = {"optional": optional, "tooltip": (tooltip or opt.help) + extra}
    if opt.choices is not None:
        return io.Combo.Input(name or key, options=list(opt.choices), default=value, **spec)
    kind = _TYPES[opt.type]
    if kind is io.String:
        return kind.Input(name or key, default=", ".join(map(str, value)) if isinstance(value, tuple) else value or "",
                          **spec)
    if kind is io.Boolean:
        return kind.Input(name or key, default=value, **spec)
    low, high = opt.bounds
    if zero_unset:
        low, value = 0, value or 0
    return kind.Input(name or key, default=value, min=low, max=high, step=opt.meta["multiple"] or opt.meta["step"] or None,
                      **spec)


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """The widgets of one node that are engine options: node input name -> option key.

    Args:
        names: the node's input names, in the node's order, each mapped to its option key (most
            are the same).
        zero_unset: inputs where 0 means unset (read as ``None``).
    """

    names: Mapping[str, str]
    zero_unset: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        messages.register(self.names)  # the engine's messages name these keys by the node's inputs

    def values(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The option values among a node's ``inputs`` (by option key); linked or missing ones
        (``None`` at validation) are left out."""
        found = {}
        for name, key in self.names.items():
            if inputs.get(name) is not None:
                value = inputs[name]
                found[key] = None if name in self.zero_unset and value == 0 else value
        return found

    def config(self, inputs: Mapping[str, Any], base: api.TrainConfig | None = None, **changes: Any) -> api.TrainConfig:
        """``base`` (default: the defaults) with the option values of ``inputs`` and ``changes``.

        Raises:
            ConfigError, ScheduleError, LoraConfigError: a value the engine refuses, named.
        """
        return (base or api.TrainConfig()).replace(**self.values(inputs), **changes)

    def validate(self, inputs: Mapping[str, Any], base: api.TrainConfig | None = None) -> bool:
        """A node's ``validate_inputs``: True when the engine takes the option values of ``inputs``.

        Raises:
            NodeError: the engine's message, naming the node's inputs (:func:`~.environment.node_error`).
                Raised, not returned: ComfyUI lists a returned message once per input the
                validator takes, a raised one once (``routes.py`` names the input it is about).
        """
        try:
            self.config(inputs, base)
        except ValueError as exc:
            raise node_error(exc) from None
        return True
