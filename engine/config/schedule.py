"""Gradient-checkpointing schedule: the six public keys, the three weight-streaming keys, their
validation, and which schedules a family can run.

The six ``gradient_checkpointing_*`` keys and their meaning come from the documents (SimpleTuner
"Segmented Checkpointing" and "Unsloth-style Checkpointing", restated in docs/SCHEDULES.md). The
three ``weight_offload*`` keys say which blocks' frozen weights live in host memory and are streamed
to the device before each use (docs/STREAMING.md). Their names are the public contract: the CLI
options, the JSON config and the ComfyUI node inputs all use them.

Layout: constants, :class:`CheckpointSchedule` (one validated config object whose fields declare
their help, flag and range), :func:`check_supported` (the family's boundaries allow it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from ..families.base import FamilyAdapter
from ..files.text import read_text, unique_keys
from .backends import BACKENDS, DEFAULT, TABLE, Backend
from .options import UNSET_WORDS, check_options, option

_HELP = {
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
    "gradient_checkpointing_save_attention": (
        "Keep the attention kernels' outputs of checkpointed regions (PyTorch selective checkpointing: the "
        "fused SDPA outputs and logsumexp are saved, everything else recomputed), so backward does not run "
        "attention again; costs their bytes per block. torch and unsloth backends (with unsloth they are "
        "offloaded with the boundary inputs)."
    ),
    "gradient_checkpointing_offload_pin_memory_max_buckets": (
        "Pinned CPU pool for offloaded tensors, in distinct (size, dtype) buckets; 0 = ordinary "
        "pageable CPU memory."
    ),
    "weight_offload": (
        "Where the frozen weights of the blocks live: none = on the device; stream = in (pinned) host "
        "memory, copied host-to-device into a small ring of device slots just before each block or "
        "segment runs (forward, recompute and backward). Saves the streamed blocks' weight bytes on the "
        "device at the cost of copies; LoRA weights and non-block weights stay resident."
    ),
    "weight_offload_blocks": (
        "How many blocks of the family's block lists stream their frozen weights (the plan chooses "
        "which, spread over the model so each copy can hide behind a resident block): all, or N. "
        "Only with weight_offload=stream."
    ),
    "weight_offload_prefetch": (
        "Streamed blocks (or segments) copied ahead of the one running; the device ring holds "
        "prefetch + 1 of them. 0 = copy each when it is needed (no overlap)."
    ),
}
WEIGHT_OFFLOAD = ("none", "stream")
"""Allowed values of ``weight_offload``."""
MAX_PREFETCH = 8
"""The largest ``weight_offload_prefetch`` (each one more device slot)."""


def _read_blocks(value: Any) -> Any:
    """``weight_offload_blocks``: ``"all"`` (any case) is unset, i.e. every block; other strings
    (``"none"`` too: it would read as "no block") are refused by the range check."""
    return None if isinstance(value, str) and value.strip().lower() == "all" else value
MAX_BLOCKS = 1024
"""The largest interval, stride and pool size the options take (no model has more blocks)."""


class ScheduleError(ValueError):
    """A schedule key has a value outside what is allowed; the message names key, value, allowed."""


def _bad(key: str, value: Any, allowed: str) -> ScheduleError:
    return ScheduleError(f"{key}={value!r} is invalid: allowed {allowed}.")


@dataclass(frozen=True)
class CheckpointSchedule:
    """The six gradient-checkpointing keys and the three weight-streaming keys, validated once at
    construction (each field's help, flag and range are in its metadata: :func:`~.options.option`).

    Attributes:
        gradient_checkpointing: master switch; ``False`` means no block is checkpointed.
        gradient_checkpointing_backend: one of :data:`BACKENDS`.
        gradient_checkpointing_interval: segment width N >= 1, or ``None`` (unset, = 1).
        gradient_checkpointing_segment_stride: period S >= N, or ``None`` (unset, = N).
        gradient_checkpointing_offload_attention: offload attention-side saved activations.
        gradient_checkpointing_offload_pin_memory_max_buckets: distinct pinned buffer keys, >= 0.
        gradient_checkpointing_save_attention: checkpointed regions keep their attention outputs
            (selective checkpointing; ``engine/core/attention_saving.py``).
        weight_offload: ``none`` or ``stream`` (frozen block weights in host memory).
        weight_offload_blocks: how many blocks stream (``None`` = all).
        weight_offload_prefetch: streamed units copied ahead, 0..8.

    Raises:
        ScheduleError: interval < 1, stride < interval, stride without interval, unknown
            backend, negative buckets, a block count without ``weight_offload=stream``, or a value
            of the wrong type. The message names the key, the value and what is allowed.

    Example:
        >>> CheckpointSchedule(gradient_checkpointing_interval=2,
        ...                    gradient_checkpointing_segment_stride=4).mode
        'interval2-stride4'
    """

    gradient_checkpointing: bool = option(True, _HELP["gradient_checkpointing"], "--no-checkpointing")
    gradient_checkpointing_backend: str = option(DEFAULT.name, _HELP["gradient_checkpointing_backend"], "--backend",
                                                 choices=BACKENDS)
    gradient_checkpointing_interval: int | None = option(None, _HELP["gradient_checkpointing_interval"], "--interval",
                                                         min=1, max=MAX_BLOCKS)
    gradient_checkpointing_segment_stride: int | None = option(
        None, _HELP["gradient_checkpointing_segment_stride"], "--stride", min=1, max=MAX_BLOCKS,
        allowed="an integer >= gradient_checkpointing_interval, or unset")
    gradient_checkpointing_offload_attention: bool = option(False, _HELP["gradient_checkpointing_offload_attention"],
                                                            "--offload-attention")
    gradient_checkpointing_offload_pin_memory_max_buckets: int = option(
        12, _HELP["gradient_checkpointing_offload_pin_memory_max_buckets"], "--pin-buckets", min=0, max=MAX_BLOCKS)
    gradient_checkpointing_save_attention: bool = option(False, _HELP["gradient_checkpointing_save_attention"],
                                                         "--save-attention")
    weight_offload: str = option("none", _HELP["weight_offload"], "--weight-offload", choices=WEIGHT_OFFLOAD)
    weight_offload_blocks: int | None = option(None, _HELP["weight_offload_blocks"], "--weight-offload-blocks", min=1,
                                               max=MAX_BLOCKS, parse=_read_blocks,
                                               allowed="all (or unset), or an integer from 1 to 1024")
    weight_offload_prefetch: int = option(1, _HELP["weight_offload_prefetch"], "--weight-offload-prefetch", min=0,
                                          max=MAX_PREFETCH)

    def __post_init__(self) -> None:
        check_options(self, ScheduleError)
        interval, stride = self.gradient_checkpointing_interval, self.gradient_checkpointing_segment_stride
        if stride is not None:
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
        if self.gradient_checkpointing_save_attention and (not self.gradient_checkpointing or self.backend.ffn_scope):
            what = ("gradient_checkpointing=False (nothing is recomputed)" if not self.gradient_checkpointing else
                    f"gradient_checkpointing_backend={self.gradient_checkpointing_backend!r} (its FFN-only regions "
                    "hold no attention)")
            raise ScheduleError(f"gradient_checkpointing_save_attention=True is invalid with {what}: allowed with the "
                                "torch or unsloth backend, or false")
        if self.weight_offload_prefetch != 1 and not self.streams:
            raise ScheduleError(f"weight_offload_prefetch={self.weight_offload_prefetch!r} is invalid with "
                                f"weight_offload={self.weight_offload!r}: allowed 1 (the default), or set "
                                "weight_offload=stream")
        if self.weight_offload_blocks is not None and not self.streams:
            raise ScheduleError(f"weight_offload_blocks={self.weight_offload_blocks!r} is invalid with "
                                f"weight_offload={self.weight_offload!r}: allowed all (unset), or set "
                                "weight_offload=stream")

    @property
    def streams(self) -> bool:
        """Whether frozen block weights stream from host memory (``weight_offload=stream``)."""
        return self.weight_offload == "stream"

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
            return ("none-offload-attn" if self.gradient_checkpointing_offload_attention else "none") + self.stream_suffix
        name = "layer" if self.interval == 1 else f"interval{self.interval}"
        if self.stride != self.interval:
            name += f"-stride{self.stride}"
        if self.backend != DEFAULT:
            name += f"-{self.gradient_checkpointing_backend}"
        if self.gradient_checkpointing_save_attention:
            name += "-save-attn"
        if self.gradient_checkpointing_offload_attention:
            name += "-offload-attn"
        return name + self.stream_suffix

    @property
    def stream_suffix(self) -> str:
        """``""``, ``-stream`` (every block) or ``-stream8`` (8 blocks); the prefetch when not 1 (``-p2``)."""
        if not self.streams:
            return ""
        suffix = "-stream" + (str(self.weight_offload_blocks) if self.weight_offload_blocks else "")
        return suffix + (f"-p{self.weight_offload_prefetch}" if self.weight_offload_prefetch != 1 else "")

    def to_dict(self) -> dict[str, Any]:
        """The nine keys as a JSON-ready dict (unset values are ``None``)."""
        return asdict(self)

    def replace(self, **changes: Any) -> "CheckpointSchedule":
        """A validated copy with some keys changed."""
        return CheckpointSchedule(**{**self.to_dict(), **changes})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "CheckpointSchedule":
        """Read the keys from a SimpleTuner-style config mapping.

        Keys that are not schedule keys are ignored (a training config holds many more); a
        leading ``--`` (SimpleTuner's files write it) is left out. The strings ``"None"``, ``"null"`` and ``""`` mean unset; ``"true"``/``"false"`` and numeric
        strings are accepted, as SimpleTuner's CLI-style configs write them. SimpleTuner's
        ``musubi_blocks_to_swap: N`` reads as ``weight_offload=stream`` with N blocks (0: none),
        unless the config sets ``weight_offload`` itself.

        Raises:
            ScheduleError: a value cannot be read as its key's type, or fails validation.
        """
        config = {k[2:] if isinstance(k, str) and k.startswith("--") else k: v for k, v in config.items()}
        values: dict[str, Any] = {}
        for key in KEYS:
            if key in config:
                values[key] = _coerce(key, config[key])
        if SWAP_ALIAS in config and "weight_offload" not in config:
            values.update(swap_alias(config[SWAP_ALIAS]))
        return cls(**{k: v for k, v in values.items() if v is not None or k in _OPTIONAL})

    @classmethod
    def from_json_file(cls, path: str | Path) -> "CheckpointSchedule":
        """Read the keys from a JSON config file (see :meth:`from_config`).

        Raises:
            ScheduleError: the file is not a JSON object, gives a key twice, or a value is invalid.
        """
        try:
            data = json.loads(read_text(path, "config file"), object_pairs_hook=unique_keys)
        except (OSError, ValueError) as exc:  # JSONDecodeError and TextFileError are ValueErrors
            raise ScheduleError(f"config file {str(path)!r} could not be read as JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ScheduleError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
        return cls.from_config(data)


KEYS = tuple(f.name for f in fields(CheckpointSchedule))
"""The ten keys: the documents' six in their order, ``gradient_checkpointing_save_attention``, then
the three weight-streaming keys."""
CHECKPOINT_KEYS = KEYS[:6]
"""The documents' six ``gradient_checkpointing_*`` keys."""
STREAM_KEYS = KEYS[7:]
"""The three ``weight_offload*`` keys."""
SWAP_ALIAS = "musubi_blocks_to_swap"
"""SimpleTuner's config key for musubi-tuner's block swap, read as the streaming keys."""


def swap_alias(value: Any) -> dict[str, Any]:
    """The streaming keys of ``musubi_blocks_to_swap: N``: N >= 1 streams N blocks, 0 or unset none.

    Raises:
        ScheduleError: N is not an integer from 0 to 1024.
    """
    blocks = _coerce(SWAP_ALIAS, value)  # an integer ("8", 8.0), or None ("none"); else named
    if blocks is None or blocks == 0:
        return {"weight_offload": "none", "weight_offload_blocks": None}
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 < blocks <= MAX_BLOCKS:
        raise _bad(SWAP_ALIAS, value, f"an integer from 0 to {MAX_BLOCKS} (0 = no block swap)")
    return {"weight_offload": "stream", "weight_offload_blocks": blocks}
HELP = {f.name: f.metadata["help"] for f in fields(CheckpointSchedule)}
_BOOLEAN_KEYS = tuple(f.name for f in fields(CheckpointSchedule) if f.type in (bool, "bool"))
"""The true/false keys (read from ``"true"``, ``"1"``, ``"yes"`` and their opposites)."""
"""One help text per key: feeds ``--help`` and the node tooltips."""
_OPTIONAL = ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride", "weight_offload_blocks")


def coerce_key(key: str, value: Any) -> Any:
    """The value of schedule key ``key`` as :meth:`CheckpointSchedule.from_config` reads it (``"true"``,
    ``"2"``, ``"None"``, ``2.0``), before validation.

    Raises:
        ScheduleError: a string that is not the key's type.
    """
    return _coerce(key, value)


def _coerce(key: str, value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if key == "weight_offload_blocks":  # "none" would read as "no block": only "all" means every block
            if text.lower() in ("all", ""):
                return None
            try:
                return int(text)
            except ValueError:
                raise _bad(key, value, "all, or an integer from 1 to 1024") from None
        if text.lower() in UNSET_WORDS:
            return None
        if key in _BOOLEAN_KEYS:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise _bad(key, value, "true or false")
        if key in ("gradient_checkpointing_backend", "weight_offload"):
            return text
        try:
            return int(text)
        except ValueError:
            raise _bad(key, value, "an integer") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def check_supported(family: FamilyAdapter, schedule: CheckpointSchedule) -> None:
    """Refuse, before any work starts, a schedule the family cannot run as asked.

    Never run a different scope silently (docs/SCHEDULES.md "Backends"): a ``*-ffn`` backend needs
    an FFN boundary, and attention offload an attention boundary, in every block list the model
    routes through the checkpoint function.

    Raises:
        ScheduleError: naming the family, the block list(s) and the option.
    """
    routed = [bl for bl in family.block_lists if bl.routed]
    backend = schedule.backend
    if schedule.gradient_checkpointing and backend.ffn_scope:
        missing = [bl.name for bl in routed if not bl.ffn]
        if missing:
            allowed = " or ".join(b.name for b in TABLE.values() if not b.ffn_scope)
            raise ScheduleError(
                f"gradient_checkpointing_backend={backend.name!r} is not available for {family.name}: block "
                f"list(s) {', '.join(missing)} have no FFN boundary; allowed {allowed}")
    if schedule.gradient_checkpointing_offload_attention:
        missing = [bl.name for bl in routed if not bl.attention]
        if missing:
            raise ScheduleError(
                f"gradient_checkpointing_offload_attention=True is not available for {family.name}: "
                f"block list(s) {', '.join(missing)} have no attention boundary; allowed false")
