"""Options declared once: each config field's help text, command-line flag, allowed values and
range live in its metadata (:func:`option`), and one validator (:func:`check_options`) checks every
field of a config against them, naming the key, the value and what is allowed.

Every front end reads the same declarations through :func:`options_of`: the ``segckpt`` flags,
the JSON reader, the ComfyUI node widgets (default, min, max, step, choices, tooltip), the
nodes' validation and the options table of docs/OPTIONS.md. The shape follows torchtitan's job config (each
option documented once, under its field); the rest of this module is ours.

Layout: :class:`ConfigError`, :class:`OptionRules`, :func:`option`, :class:`Option`, :func:`check_options`,
:func:`options_of`.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypedDict

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack

UNSET_WORDS = ("", "none", "null")
"""Strings that mean "unset" for an option that may be unset (SimpleTuner's configs write them)."""


class ConfigError(ValueError):
    """An option is invalid; the message names the key, the value and what is allowed."""


class ConfigWarning(UserWarning):
    """An option is valid but does something the user may not expect; the message says what."""


class OptionRules(TypedDict, total=False):
    """What an option declares beyond its default, help text and flag (:func:`option`'s keywords).

    Attributes:
        choices: the allowed values (or a function returning them, read when checked).
        min, max: inclusive bounds of a number. above, below: exclusive bounds of a number.
        off: one more allowed value outside the bounds that turns the option off (e.g. 0).
        multiple: an integer must be a multiple of this (the node widget's step too).
        allowed: the "allowed ..." text of the error, when the generated one would not say it.
        parse: ``value -> value``: reads and normalises the value (raising the project's own
            ``ValueError`` that names the key, the value and what is allowed); runs before the
            other checks.
        key: the flat config key when it differs from the field name (``lora_rank``).
        step: the node widget's step (presentation only).
        long_run: an option of ``segckpt train`` only (steps, saving, resuming), not of the short
            measurement runs of ``sweep`` and ``plan`` (default False).
    """

    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None
    min: float | None
    max: float | None
    above: float | None
    below: float | None
    off: Any
    multiple: int | None
    allowed: str | None
    parse: Callable[[Any], Any] | None
    key: str | None
    step: float | None
    long_run: bool


RULES = {**dict.fromkeys(OptionRules.__annotations__), "long_run": False}
"""Every rule of :class:`OptionRules` with its value when an option does not declare it."""


def option(default: Any, help: str, cli: str | None = None, **rules: Unpack[OptionRules]) -> Any:
    """A config field documented once: its metadata holds everything a front end shows.

    Args:
        default: the default value (a callable: a default factory).
        help: the text of ``--help``, of the node tooltips and of docs/OPTIONS.md's options table.
        cli: the ``segckpt`` flag (``None``: not a flag).
        rules: the option's checks and presentation, by name (:class:`OptionRules`).

    Raises:
        TypeError: a rule :class:`OptionRules` does not name (as a misspelt keyword argument would).
    """
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        raise TypeError(f"option() got unexpected keyword arguments {', '.join(unknown)}: allowed {', '.join(RULES)}")
    meta = {"help": help, "cli": cli, **RULES, **rules, "option": True}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Option:
    """One declared option, as every front end sees it.

    Attributes:
        key: the flat config key (JSON, node input name by default).
        path: where it lives in the config tree (``("data", "resolution")``).
        type: its Python type: ``bool``, ``int``, ``float``, ``str`` or ``tuple`` (a list of strings).
        optional: ``None`` (unset) is allowed.
        default: the default value.
        meta: the field's metadata (see :func:`option`).
    """

    key: str
    path: tuple[str, ...]
    type: type
    optional: bool
    default: Any
    meta: dict[str, Any]

    @property
    def help(self) -> str:
        return self.meta["help"]

    @property
    def cli(self) -> str | None:
        return self.meta["cli"]

    @property
    def choices(self) -> tuple[Any, ...] | None:
        choices = self.meta["choices"]
        return tuple(choices() if callable(choices) else choices) if choices is not None else None

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """``(lowest, highest)`` a widget shows: ``min`` or ``above`` (or ``off`` when lower), ``max``."""
        low = self.meta["min"] if self.meta["min"] is not None else self.meta["above"]
        if self.meta["off"] is not None and low is not None:
            low = min(low, self.meta["off"])
        return low, self.meta["max"] if self.meta["max"] is not None else self.meta["below"]

    def allowed(self) -> str:
        """What the error message says is allowed."""
        if self.meta["allowed"]:
            return self.meta["allowed"]
        unset = ", or unset" if self.optional else ""
        if self.choices is not None:
            return ", ".join(map(str, self.choices)) + unset
        if self.type is bool:
            return "true or false"
        low, high, above, below = self.meta["min"], self.meta["max"], self.meta["above"], self.meta["below"]
        noun = "an integer" if self.type is int else "a finite number" if self.type is float else None
        if self.meta["multiple"]:
            noun = f"a multiple of {self.meta['multiple']}"
        if self.type is str:
            return "a path (string) or unset" if self.optional else "a non-empty string"
        if noun is None:
            return "a list of strings" + unset
        if below is not None:
            text = f"{noun} >= {_num(low)} and < {_num(below)}"
        elif above is not None:
            text = f"{noun} > {_num(above)}" + (f" and <= {_num(high)}" if high is not None else "")
        elif low is not None and high is not None:
            text = f"{noun} from {_num(low)} to {_num(high)}"
        elif low is not None:
            text = f"{noun} >= {_num(low)}"
        else:
            text = noun
        if self.meta["off"] is not None:
            text += f", or {_num(self.meta['off'])} (off)"
        return text + unset


def _num(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 2**32 and value == 2 ** (value.bit_length()) - 1:
        return f"2**{value.bit_length()}-1"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _type_of(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> ``(int, True)``; ``tuple[str, ...] | None`` -> ``(tuple, True)``."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if origin is tuple:
        return tuple, optional
    return (hint if isinstance(hint, type) else object), optional


def _fields(cls: type) -> list[tuple[Field, type, bool]]:
    hints = typing.get_type_hints(cls)
    return [(f, *_type_of(hints[f.name])) for f in fields(cls) if f.metadata.get("option")]


def _default(f: Field) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def _coerce_strings(value: Any) -> Any:
    """One string as a one-element tuple, a list as a tuple; other values unchanged."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(value)
    return value


def _check(opt: Option, value: Any, error: type[ValueError]) -> Any:
    """``value`` normalised, or ``error`` naming the key, the value and what is allowed."""
    def bad() -> ValueError:
        return error(f"{opt.key}={value!r} is invalid: allowed {opt.allowed()}.")

    if opt.meta["parse"] is not None:  # raises the config's own error, naming what is allowed
        value = opt.meta["parse"](value)
    if value is None:
        if not opt.optional:
            raise bad()
        return None
    if opt.type is tuple and opt.meta["parse"] is not None:  # parsed: a tuple of its own items
        return value
    if opt.type is tuple:
        value = _coerce_strings(value)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise bad()
        return value
    if opt.choices is not None:
        if isinstance(value, bool) != (opt.type is bool) or value not in opt.choices:
            raise bad()
        return value
    if opt.type is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if opt.type is str:
        if not isinstance(value, str) or (not opt.optional and not value):
            raise bad()
        return value
    if opt.type is int and not _is_int(value) or opt.type is float and not _is_number(value):
        raise bad()
    if opt.meta["off"] is not None and value == opt.meta["off"]:
        return value
    low, high, above, below = opt.meta["min"], opt.meta["max"], opt.meta["above"], opt.meta["below"]
    if (low is not None and value < low or high is not None and value > high or above is not None and value <= above
            or below is not None and value >= below):
        raise bad()
    if opt.meta["multiple"] and value % opt.meta["multiple"]:
        raise bad()
    return value


def check_options(config: Any, error: type[ValueError] = ConfigError) -> None:
    """Check every declared field of the (frozen) dataclass ``config`` against its metadata and
    store the normalised values (a list as a tuple, a parsed string).

    Raises:
        ``error``: the first invalid field, naming its key, its value and what is allowed.
    """
    for f, kind, optional in _fields(type(config)):
        opt = Option(f.metadata["key"] or f.name, (f.name,), kind, optional, _default(f), dict(f.metadata))
        value = _check(opt, getattr(config, f.name), error)
        if value is not getattr(config, f.name):
            object.__setattr__(config, f.name, value)


def options_of(cls: type, path: tuple[str, ...] = (), defaults: Any = None) -> list[Option]:
    """Every declared option of the config class ``cls`` and of the config classes it nests (a
    field whose type is a dataclass), depth first in field order.

    Args:
        defaults: an instance of ``cls`` whose values are the options' defaults (a component's
            defaults inside its parent: the demo schedule of a run); default: ``cls()``.

    Raises:
        ValueError: two options share a key.
    """
    found: list[Option] = []
    hints = typing.get_type_hints(cls)
    defaults = cls() if defaults is None else defaults
    for f in fields(cls):
        kind, optional = _type_of(hints[f.name])
        value = getattr(defaults, f.name)
        if f.metadata.get("option"):
            found.append(Option(f.metadata["key"] or f.name, (*path, f.name), kind, optional, value, dict(f.metadata)))
        elif is_dataclass(kind):
            found += options_of(kind, (*path, f.name), value if value is not None else kind())
    keys = [o.key for o in found]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"options declared twice: {', '.join(duplicates)}")
    return found
