"""Gradient-checkpointing schedule: the six public keys, their validation, and the block plan.

The keys and their meaning come from the documents (SimpleTuner "Segmented Checkpointing" and
"Unsloth-style Checkpointing", restated in SPEC.md "The controls"). Their names are the public
contract: the CLI options, the JSON config and the ComfyUI node inputs all use them.

Layout: constants, :class:`CheckpointSchedule` (one validated config object), :class:`ListPlan`
(the plan of one block list) and the pure function :func:`plan_block_list`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .backends import BACKENDS, DEFAULT, TABLE, Backend

KEYS = (
    "gradient_checkpointing",
    "gradient_checkpointing_backend",
    "gradient_checkpointing_interval",
    "gradient_checkpointing_segment_stride",
    "gradient_checkpointing_offload_attention",
    "gradient_checkpointing_offload_pin_memory_max_buckets",
)

_UNSET_STRINGS = ("", "none", "null")

HELP = {
    "gradient_checkpointing": "Master switch. false = no activation checkpointing (fastest, highest peak).",
    "gradient_checkpointing_backend": (
        "What a checkpointed region does with its activations: torch = discard and recompute; "
        "torch-ffn = only the feed-forward sub-block; unsloth = recompute, keeping boundary inputs "
        "in CPU memory; unsloth-ffn = both."
    ),
    "gradient_checkpointing_interval": (
        "Segment width N: N consecutive blocks run inside ONE checkpoint call. 1 (or unset) = "
        "ordinary per-block checkpointing. Larger groups store fewer boundary states but do not "
        "reduce recompute, and raise the transient backward peak."
    ),
    "gradient_checkpointing_segment_stride": (
        "Period S >= N of the pattern: checkpoint blocks [k*S, k*S+N) and run the others normally "
        "(their activations are kept, so they are not recomputed). Unset = S equals N (every block "
        "checkpointed). Requires an interval."
    ),
    "gradient_checkpointing_offload_attention": (
        "Offload the attention side's saved activations to CPU memory (families with an "
        "attention/FFN split)."
    ),
    "gradient_checkpointing_offload_pin_memory_max_buckets": (
        "Pinned CPU pool for offloaded tensors, in distinct (size, dtype) buckets; 0 = ordinary "
        "pageable CPU memory."
    ),
}
"""One help text per key: feeds ``--help`` and the node tooltips."""


class ScheduleError(ValueError):
    """A schedule key has a value outside what is allowed; the message names key, value, allowed."""


def _bad(key: str, value: Any, allowed: str) -> ScheduleError:
    return ScheduleError(f"{key}={value!r} is invalid: allowed {allowed}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CheckpointSchedule:
    """The six gradient-checkpointing keys, validated once at construction.

    Attributes:
        gradient_checkpointing: master switch; ``False`` means no block is checkpointed.
        gradient_checkpointing_backend: one of :data:`BACKENDS`.
        gradient_checkpointing_interval: segment width N >= 1, or ``None`` (unset, = 1).
        gradient_checkpointing_segment_stride: period S >= N, or ``None`` (unset, = N).
        gradient_checkpointing_offload_attention: offload attention-side saved activations.
        gradient_checkpointing_offload_pin_memory_max_buckets: distinct pinned buffer keys, >= 0.

    Raises:
        ScheduleError: interval < 1, stride < interval, stride without interval, unknown
            backend, negative buckets, or a value of the wrong type. The message names the key,
            the value and what is allowed.

    Example:
        >>> CheckpointSchedule(gradient_checkpointing_interval=2,
        ...                    gradient_checkpointing_segment_stride=4).mode
        'interval2-stride4'
    """

    gradient_checkpointing: bool = True
    gradient_checkpointing_backend: str = DEFAULT.name
    gradient_checkpointing_interval: int | None = None
    gradient_checkpointing_segment_stride: int | None = None
    gradient_checkpointing_offload_attention: bool = False
    gradient_checkpointing_offload_pin_memory_max_buckets: int = 12

    def __post_init__(self) -> None:
        for key in ("gradient_checkpointing", "gradient_checkpointing_offload_attention"):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "true or false")
        backend = self.gradient_checkpointing_backend
        if backend not in BACKENDS:
            raise _bad("gradient_checkpointing_backend", backend, "one of " + ", ".join(BACKENDS))
        interval = self.gradient_checkpointing_interval
        if interval is not None and (not _is_int(interval) or interval < 1):
            raise _bad("gradient_checkpointing_interval", interval, "an integer >= 1, or unset")
        stride = self.gradient_checkpointing_segment_stride
        if stride is not None:
            if not _is_int(stride):
                raise _bad("gradient_checkpointing_segment_stride", stride, "an integer >= interval, or unset")
            if interval is None:
                raise ScheduleError(
                    f"gradient_checkpointing_segment_stride={stride!r} is invalid without "
                    "gradient_checkpointing_interval: set the interval (segment width) too, "
                    "or unset the stride."
                )
            if stride < interval:
                raise _bad(
                    "gradient_checkpointing_segment_stride",
                    stride,
                    f"an integer >= gradient_checkpointing_interval ({interval}); smaller strides overlap",
                )
        buckets = self.gradient_checkpointing_offload_pin_memory_max_buckets
        if not _is_int(buckets) or buckets < 0:
            raise _bad("gradient_checkpointing_offload_pin_memory_max_buckets", buckets, "an integer >= 0")

    @property
    def backend(self) -> Backend:
        """The :class:`~.backends.Backend` row of ``gradient_checkpointing_backend``."""
        return TABLE[self.gradient_checkpointing_backend]

    @property
    def interval(self) -> int:
        """Effective segment width N (1 when unset)."""
        return self.gradient_checkpointing_interval or 1

    @property
    def stride(self) -> int:
        """Effective period S (N when unset)."""
        return self.gradient_checkpointing_segment_stride or self.interval

    @property
    def mode(self) -> str:
        """Short name of the schedule: ``none``, ``layer``, ``interval2``, ``interval2-stride4``."""
        if not self.gradient_checkpointing:
            return "none-offload-attn" if self.gradient_checkpointing_offload_attention else "none"
        name = "layer" if self.interval == 1 else f"interval{self.interval}"
        if self.stride != self.interval:
            name += f"-stride{self.stride}"
        if self.backend != DEFAULT:
            name += f"-{self.gradient_checkpointing_backend}"
        if self.gradient_checkpointing_offload_attention:
            name += "-offload-attn"
        return name

    def to_dict(self) -> dict[str, Any]:
        """The six keys as a JSON-ready dict (unset values are ``None``)."""
        return asdict(self)

    def replace(self, **changes: Any) -> "CheckpointSchedule":
        """A validated copy with some keys changed."""
        return CheckpointSchedule(**{**self.to_dict(), **changes})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "CheckpointSchedule":
        """Read the keys from a SimpleTuner-style config mapping.

        Keys that are not schedule keys are ignored (a training config holds many more). The
        strings ``"None"``, ``"null"`` and ``""`` mean unset; ``"true"``/``"false"`` and numeric
        strings are accepted, as SimpleTuner's CLI-style configs write them.

        Raises:
            ScheduleError: a value cannot be read as its key's type, or fails validation.
        """
        values: dict[str, Any] = {}
        for key in KEYS:
            if key in config:
                values[key] = _coerce(key, config[key])
        return cls(**{k: v for k, v in values.items() if v is not None or k in _OPTIONAL})

    @classmethod
    def from_json_file(cls, path: str | Path) -> "CheckpointSchedule":
        """Read the keys from a JSON config file (see :meth:`from_config`).

        Raises:
            ScheduleError: the file is not a JSON object, or a value is invalid.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"config file {str(path)!r} could not be read as JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ScheduleError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        return cls.from_config(data)


_OPTIONAL = ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")


def _coerce(key: str, value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in _UNSET_STRINGS:
            return None
        if key in ("gradient_checkpointing", "gradient_checkpointing_offload_attention"):
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise _bad(key, value, "true or false")
        if key == "gradient_checkpointing_backend":
            return text
        try:
            return int(text)
        except ValueError:
            raise _bad(key, value, "an integer") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True)
class ListPlan:
    """The effective plan of one block list.

    Attributes:
        name: the block list's short name (e.g. ``double``).
        num_blocks: number of blocks n in the list.
        segments: checkpointed segments as half-open ``(start, end)`` block index ranges; each is
            ONE checkpoint call. Empty when nothing is checkpointed.
        notes: why the plan differs from what the schedule asked, if it does.
        routed: ``False`` for a list the model's loop calls directly, never through the
            checkpoint function: no schedule or offload option can act on it.
    """

    name: str
    num_blocks: int
    segments: tuple[tuple[int, int], ...]
    notes: tuple[str, ...] = field(default=())
    routed: bool = True

    @property
    def checkpointed(self) -> tuple[int, ...]:
        """Indices of checkpointed blocks (each recomputed once in backward)."""
        return tuple(i for start, end in self.segments for i in range(start, end))

    @property
    def plain(self) -> tuple[int, ...]:
        """Indices of blocks that run normally (activations kept)."""
        done = set(self.checkpointed)
        return tuple(i for i in range(self.num_blocks) if i not in done)

    def block_map(self, mark: str = "C", plain_mark: str = ".") -> str:
        """One character per block: ``mark`` for checkpointed blocks, ``plain_mark`` for the others."""
        done = set(self.checkpointed)
        return "".join(mark if i in done else plain_mark for i in range(self.num_blocks))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, including checkpointed/plain indices."""
        return {
            "name": self.name,
            "num_blocks": self.num_blocks,
            "segments": [list(s) for s in self.segments],
            "checkpointed": list(self.checkpointed),
            "plain": list(self.plain),
            "routed": self.routed,
            "notes": list(self.notes),
        }


def plan_block_list(name: str, num_blocks: int, interval: int, stride: int | None = None,
                    enabled: bool = True, notes: tuple[str, ...] = (), routed: bool = True) -> ListPlan:
    """Pure function: the checkpointed segments of a list of ``num_blocks`` blocks.

    With interval N and stride S (S defaults to N) the segments are ``[k*S, min(k*S+N, n))`` for
    k = 0, 1, ... while ``k*S < n`` (SPEC.md "Semantics"). A tail shorter than N is a shorter last
    segment; no block is ever dropped. N = 1 gives exactly per-block checkpointing.

    Args:
        name: the list's short name, carried into the plan.
        num_blocks: n >= 0.
        interval: N >= 1.
        stride: S >= N, or ``None`` for S = N.
        enabled: ``False`` gives an empty plan (every block plain).
        notes: free-text notes carried into the plan.
        routed: see :attr:`ListPlan.routed` (an unrouted list gets an empty plan).

    Raises:
        ScheduleError: N < 1 or S < N.
    """
    stride = interval if stride is None else stride
    if interval < 1:
        raise _bad("gradient_checkpointing_interval", interval, "an integer >= 1")
    if stride < interval:
        raise _bad("gradient_checkpointing_segment_stride", stride, f"an integer >= {interval}")
    segments: tuple[tuple[int, int], ...] = ()
    if enabled and routed:
        segments = tuple((s, min(s + interval, num_blocks)) for s in range(0, num_blocks, stride))
    return ListPlan(name=name, num_blocks=num_blocks, segments=segments, notes=tuple(notes), routed=routed)
