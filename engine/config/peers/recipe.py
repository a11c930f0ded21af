"""The training recipe as SimpleTuner and diffusers' training scripts state it: their noise-schedule,
guidance and LyCORIS keys read as ours, and SimpleTuner's defaults for the keys a SimpleTuner file
leaves out (docs/OPTIONS.md "SimpleTuner configs" lists both; the table of defaults is generated from
:data:`DEFAULTS`).

SimpleTuner's values are those of bghira/SimpleTuner at bc8e6ab77 (2026-08-22): its command line is
built from the field registry (``simpletuner/simpletuner_sdk/server/services/field_registry/sections/``,
:data:`SOURCE`), and its flow shift is applied by ``apply_flow_schedule_shift``
(``simpletuner/helpers/training/custom_schedule.py``: a static ``flow_schedule_shift`` > 0, else with
``flow_schedule_auto_shift`` the resolution's shift). diffusers' names are those of
``examples/dreambooth/train_dreambooth_lora_sd3.py`` and ``..._flux.py`` (``weighting_scheme``,
``guidance_scale``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..options import UNSET_WORDS, ConfigError

SOURCE = "bghira/SimpleTuner bc8e6ab77, simpletuner/simpletuner_sdk/server/services/field_registry/sections/"
"""Where SimpleTuner declares its defaults (one file per section, named in :data:`DEFAULTS`)."""

LYCORIS_DEFAULT = "config/lycoris_config.json"
"""SimpleTuner's ``lycoris_config`` default (``sections/lora.py``), read from the working directory."""


def _refuse(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: allowed {allowed}.")


def _flag(key: str, value: Any) -> bool:
    """A SimpleTuner switch: a JSON boolean, or ``"true"`` / ``"false"`` as its CLI-style files write it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _refuse(key, value, "true or false")


def _number(key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _refuse(key, value, "a number") from None
    if isinstance(value, bool) or number != number:
        raise _refuse(key, value, "a number")
    return number


def flow_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """``flow_schedule_shift`` and ``flow_schedule_auto_shift`` as ``flow_shift``, read together as
    ``apply_flow_schedule_shift`` reads them: a static shift > 0 wins; else auto shift on: ``auto``
    (the family's own resolution-dependent shift; SimpleTuner takes Flux's ``calculate_shift`` for
    every family); else no shift (``1``). ``{}`` when neither key is given.

    Raises:
        ConfigError: a shift that is not a number >= 0, or an auto shift that is not a switch.
    """
    if "flow_schedule_shift" not in values and "flow_schedule_auto_shift" not in values:
        return {}
    shift = values.get("flow_schedule_shift")
    if shift is not None and not (isinstance(shift, str) and shift.strip().lower() in UNSET_WORDS):
        shift = _number("flow_schedule_shift", shift)
        if shift < 0:
            raise _refuse("flow_schedule_shift", values["flow_schedule_shift"], "a number >= 0 (0: none, or auto "
                          "shift with flow_schedule_auto_shift)")
        if shift > 0:
            return {"flow_shift": shift}
    auto = _flag("flow_schedule_auto_shift", values.get("flow_schedule_auto_shift", False))
    return {"flow_shift": "auto" if auto else 1.0}


def uniform_schedule(value: Any) -> dict[str, Any]:
    """``flow_use_uniform_schedule``: true draws noise levels uniformly."""
    return {"timestep_sampling": "uniform"} if _flag("flow_use_uniform_schedule", value) else {}


WEIGHTING_SCHEMES = {"none": ("uniform", "none"), "logit_normal": ("logit_normal", "none"), "mode": ("mode", "none"),
                     "sigma_sqrt": ("uniform", "sigma_sqrt"), "cosmap": ("uniform", "cosmap")}
"""diffusers' ``weighting_scheme``: ``compute_density_for_timestep_sampling`` draws uniformly for
every scheme but ``logit_normal`` and ``mode``, and ``compute_loss_weighting_for_sd3`` weights only
``sigma_sqrt`` and ``cosmap``: ``scheme -> (timestep_sampling, loss_weighting)``."""


def weighting_scheme(value: Any) -> dict[str, Any]:
    """diffusers' ``weighting_scheme`` as ``timestep_sampling`` and ``loss_weighting`` (:data:`WEIGHTING_SCHEMES`).

    Raises:
        ConfigError: another scheme, naming those allowed.
    """
    if not isinstance(value, str) or value not in WEIGHTING_SCHEMES:
        raise _refuse("weighting_scheme", value, ", ".join(WEIGHTING_SCHEMES) + " (diffusers' training scripts)")
    sampling, weighting = WEIGHTING_SCHEMES[value]
    return {"timestep_sampling": sampling, "loss_weighting": weighting}


LYCORIS_KEYS = {"algo": "lora_type", "linear_dim": "lora_rank", "linear_alpha": "lora_alpha", "factor": "lokr_factor"}
"""A LyCORIS config's keys read here, as ours (``factor``: LoKr only)."""
LYCORIS_SAME_MATH = ("multiplier", "bypass_mode", "apply_preset")
"""Keys of a LyCORIS config that change nothing trained here, where their values are those
:func:`read_lycoris` accepts."""


def read_lycoris(path: Any) -> dict[str, Any]:
    """SimpleTuner's ``lycoris_config``: a LyCORIS JSON file (``algo`` lokr or loha, ``linear_dim``,
    ``linear_alpha``, ``factor``, ``full_matrix``) as ``lora_type``, ``lora_rank``, ``lora_alpha``,
    ``lokr_factor``, ``lokr_full_matrix`` (whose rank and alpha LyCORIS ignores).

    Raises:
        ConfigError: the file cannot be read; another algorithm; ``full_matrix`` not a switch, or
            true with loha; per-module factors (``apply_preset.module_algo_map``); a multiplier other than 1;
            any other key. Each names the key, the value and what is allowed.
    """
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError) as exc:
        raise _refuse("lycoris_config", path, f"a readable LyCORIS JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse("lycoris_config", path, "a JSON object (LyCORIS' algo, linear_dim, linear_alpha, factor)")
    if config.get("algo") not in ("lokr", "loha"):
        raise _refuse(f"lycoris_config {path}: algo", config.get("algo"), "lokr or loha (peft's LoKr and LoHa)")
    full = config.get("full_matrix", False)
    rules = (("full_matrix", isinstance(full, bool) and (not full or config["algo"] == "lokr"),
              "true or false; true with algo lokr"),
             ("multiplier", config.get("multiplier", 1.0) == 1.0, "1"),
             ("apply_preset", not (config.get("apply_preset") or {}).get("module_algo_map"), "no module_algo_map "
              "(one factor and rank for every module; targets follow lora_target_modules)"))
    for key, fine, allowed in rules:
        if not fine:
            raise _refuse(f"lycoris_config {path}: {key}", config[key], allowed)
    unknown = sorted(set(config) - set(LYCORIS_KEYS) - set(LYCORIS_SAME_MATH) - {"full_matrix"})
    if unknown:
        raise _refuse(f"lycoris_config {path}: {unknown[0]}", config[unknown[0]],
                      f"only {', '.join([*LYCORIS_KEYS, *LYCORIS_SAME_MATH, 'full_matrix'])}")
    dim = config.get("linear_dim", 16)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim > 4096 and config["algo"] != "lokr":
        raise _refuse(f"lycoris_config {path}: linear_dim", dim, "an integer from 1 to 4096 (lora_rank's range), or "
                      "above with algo lokr (full matrices)")
    if full or dim > 4096:  # LyCORIS keeps a LoKr's factors whole (scale 1) at a rank of half their size or more
        return {"lora_type": "lokr", "lokr_full_matrix": True, "lokr_factor": config.get("factor", -1)}
    if config["algo"] != "lokr" and config.get("factor", -1) != -1:
        raise _refuse(f"lycoris_config {path}: factor", config["factor"], "-1 with algo loha (LoKr's Kronecker "
                      "factor)")
    return {ours: config[key] for key, ours in LYCORIS_KEYS.items() if key in config}


@dataclass(frozen=True)
class Default:
    """A SimpleTuner default taken for a key its file leaves out (where it differs from ours and
    changes what is trained).

    Attributes:
        key: SimpleTuner's key, read through its alias. value: its default (``None``: see ``meaning``).
        ours: our key and its default, for docs/OPTIONS.md. source: the field registry section file.
        applies: ``(file values, flow family) -> bool``: whether it is taken for this file.
        meaning: docs/OPTIONS.md's note.
    """

    key: str
    value: Any
    ours: str
    source: str
    applies: Callable[[Mapping[str, Any], bool], bool] = lambda values, flow: True
    meaning: str = ""


def _plain_lora(values: Mapping[str, Any], flow: bool) -> bool:
    return values.get("lora_type", "standard") in ("standard", "lora") and "lycoris_config" not in values


DEFAULTS = (
    Default("learning_rate", 4e-7, "learning_rate 0.001", "training.py"),
    Default("train_batch_size", 4, "batch_size 1", "training.py"),
    Default("resolution", 1024, "resolution 256", "data.py"),
    Default("adam_weight_decay", 1e-2, "weight_decay 0", "optimizer.py"),
    Default("max_grad_norm", 2.0, "max_grad_norm 1", "optimizer.py"),
    Default("caption_dropout_probability", 0.1, "caption_dropout 0", "advanced.py"),
    Default("flow_schedule_shift", 3.0, "flow_shift auto", "advanced.py",
            lambda values, flow: flow and "flow_schedule_auto_shift" not in values,
            "flow families; not with flow_schedule_auto_shift (auto then)"),
    Default("lora_dropout", 0.1, "lora_dropout 0", "lora.py", _plain_lora, "lora_type standard"),
    Default("lora_alpha", None, "lora_alpha 16", "lora.py", meaning="None: alpha = lora_rank (the update scale 1)"),
)
"""SimpleTuner's defaults that differ from ours and change what is trained (:data:`DEFAULTS_NOTE`)."""
DEFAULTS_NOTE = ("Not taken: defaults that change no trained value (previews, memory and speed settings), "
                 "mixed_precision bf16 (auto chooses bf16 where the device has it) and seed None (SimpleTuner's random "
                 "seed; a run here is reproducible). The optimizer default adamw_bf16 reads as adamw, ours; "
                 "lr_scheduler constant_with_warmup as constant, ours.")


def grouped_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """The SimpleTuner keys read together, as ours: the flow shift pair (:func:`flow_keys`) and
    ``lora_type`` lycoris with its ``lycoris_config`` (:func:`read_lycoris`; the file SimpleTuner
    defaults to when none is named). Returns ``(our values, the keys consumed)``.

    Raises:
        ConfigError: see :func:`flow_keys` and :func:`read_lycoris`.
    """
    read = flow_keys(values)
    used = {"flow_schedule_shift", "flow_schedule_auto_shift"} & set(values)
    if values.get("lora_type") == "lycoris":
        read.update(read_lycoris(values.get("lycoris_config", LYCORIS_DEFAULT)))
        used |= {"lora_type", "lycoris_config"} & set(values)
    return read, used


def take_defaults(values: Mapping[str, Any], read: Mapping[str, Any], flow: bool) -> tuple[dict[str, Any], list[str]]:
    """``values`` with SimpleTuner's :data:`DEFAULTS` for the keys it leaves out, and their names.

    Args:
        values: a SimpleTuner file's flat keys.
        read: the file read as our keys (a default is not taken for a key of ours it sets).
        flow: the file's family is a flow family.
    """
    out, taken = dict(values), []
    for default in DEFAULTS:
        ours = default.ours.split()[0]
        if default.key in values or ours in read or not default.applies(values, flow):
            continue
        value = default.value
        if default.key == "lora_alpha":
            value = read.get("lora_rank", 16)
        out[default.key] = value
        taken.append(f"{default.key}={value!r}")
    return out, taken
