"""SimpleTuner's config keys, read with the meaning they have in SimpleTuner (docs/OPTIONS.md "SimpleTuner configs").

A SimpleTuner ``config.json`` holds its command-line options by name, with or without the leading
``--``; the files its web UI saves wrap them as ``{"_metadata": {...}, "config": {...}}``.
:func:`flat_keys` unwraps such a file and strips the dashes; :func:`read_keys` then turns the keys
into ours: :data:`ALIASES` (a SimpleTuner key with a meaning here, and how its value reads),
:data:`SAME_KEYS` (keys both projects spell alike, with the same meaning), :data:`IGNORED` (keys
with no meaning here, and why); any other key is not one of ours and is ignored too, unless it is
a near miss of one of ours (:func:`near_miss`: ``lora_rnak``, ``Lora-Rank``, the flag name ``rank``),
which is refused with the key it meant. Every ignored key is returned by name, so the caller warns
once and records them (:meth:`~..train.TrainConfig.from_json_file`). The SimpleTuner meanings are restated from its
options documentation; docs/OPTIONS.md's table of them is generated from these tables
(:func:`~..table.simpletuner_table`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..options import UNSET_WORDS, ConfigError
from ..schedule import SWAP_ALIAS, swap_alias
from .recipe import grouped_keys, take_defaults, uniform_schedule, weighting_scheme

FAMILY_NAMES = {"ace_step": "acestep", "cosmos2image": "cosmos", "ernie": "ernieimage", "kandinsky5_image": "kandinsky5",
                "kandinsky5-image": "kandinsky5", "longcat_image": "longcatimage", "ltxvideo2": "ltx2video",
                "pixart_sigma": "pixart", "qwen_image": "qwenimage", "stable_cascade": "stablecascade",
                "z_image": "zimage"}
"""SimpleTuner ``model_family`` names that differ from our family names (the others are spelled alike)."""

ATTENTION = {"diffusers": "auto", "native-flash": "flash", "native-efficient": "efficient", "native-math": "math",
             "cudnn": "cudnn"}
"""SimpleTuner ``attention_mechanism`` values that select PyTorch SDPA kernels, as ``attention_backend``."""


@dataclass(frozen=True)
class Alias:
    """A SimpleTuner key with a meaning here.

    Attributes:
        key: SimpleTuner's key. ours: the key(s) it sets here (docs/OPTIONS.md). meaning: what it does here (docs/OPTIONS.md).
        read: ``value -> {our key: value}`` (``{}``: accepted, nothing to set); raises
            :class:`~..options.ConfigError` naming the key, the value and what is allowed.
        peer: whose name it is: ``SimpleTuner``, or ``diffusers`` (its training scripts' flags).
    """

    key: str
    ours: str
    meaning: str
    read: Callable[[Any], dict[str, Any]]
    peer: str = "SimpleTuner"


def _refuse(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: allowed {allowed}.")


def _as(ours: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {ours: value}


def _family(value: Any) -> dict[str, Any]:
    return {"family": FAMILY_NAMES.get(value, value) if isinstance(value, str) else value}


def _model(value: Any) -> dict[str, Any]:
    if isinstance(value, str) and value.lower().endswith((".safetensors", ".gguf")):
        return {"model_file": value}
    return {"model_path": value}


def _unset(value: Any) -> bool:
    return value is None or value is False or isinstance(value, str) and value.strip().lower() in UNSET_WORDS


def _resume(value: Any) -> dict[str, Any]:
    if _unset(value):
        return {"resume": False}
    if value == "latest":
        return {"resume": True}
    raise _refuse("resume_from_checkpoint", value, "latest (continue the state in output_dir) or unset; a "
                  "checkpoint folder is not read here")


def _attention(value: Any) -> dict[str, Any]:
    if not isinstance(value, str) or value not in ATTENTION:
        raise _refuse("attention_mechanism", value, ", ".join(ATTENTION) + " (PyTorch SDPA kernels; the others are "
                      "not used here)")
    return {"attention_backend": ATTENTION[value]}


def _one_of(key: str, allowed: tuple[str, ...], why: str) -> Callable[[Any], dict[str, Any]]:
    def read(value: Any) -> dict[str, Any]:
        if value not in allowed:
            raise _refuse(key, value, f"{', '.join(allowed)} ({why})")
        return {}
    return read


ALIASES: dict[str, Alias] = {a.key: a for a in (
    Alias("model_family", "family", "the model family; SimpleTuner's names that differ from ours (pixart_sigma, "
          "qwen_image, z_image, ...) read as ours", _family),
    Alias("pretrained_model_name_or_path", "model_path, model_file", "a local diffusers folder (model_path), or one "
          ".safetensors or .gguf file (model_file); never downloaded, so a Hub name is refused as a missing folder", _model),
    Alias("pretrained_vae_model_name_or_path", "vae_path", "the local VAE folder", _as("vae_path")),
    Alias("instance_data_dir", "data", "the image folder", _as("data")),
    Alias("output_dir", "output", "the output folder", _as("output")),
    Alias("max_train_steps", "steps", "optimizer steps in all", _as("steps")),
    Alias("train_batch_size", "batch_size", "images per micro-batch on each process (a global batch of "
          "train_batch_size x processes under fsdp, as in SimpleTuner)", _as("batch_size")),
    Alias("adam_weight_decay", "weight_decay", "AdamW's decoupled weight decay", _as("weight_decay")),
    Alias("checkpoint_step_interval", "save_every", "save the resumable state every N steps", _as("save_every")),
    Alias("checkpointing_steps", "save_every", "save the resumable state every N steps (the older name)",
          _as("save_every")),
    Alias("resume_from_checkpoint", "resume", "latest: continue the state in output_dir; unset: a new run; a "
          "checkpoint folder is refused", _resume),
    Alias("validation_steps", "validation_every", "sample the previews every N steps", _as("validation_every")),
    Alias("validation_prompt", "validation_prompts", "the preview prompt", _as("validation_prompts")),
    Alias("attention_mechanism", "attention_backend", "diffusers: auto; native-flash, native-efficient, native-math, "
          "cudnn: that SDPA kernel; the others are refused", _attention),
    Alias(SWAP_ALIAS, "weight_offload, weight_offload_blocks", "N >= 1 streams the frozen weights of N blocks from "
          "host memory; 0: none", swap_alias),
    Alias("caption_dropout_probability", "caption_dropout", "the probability that a sample trains with the empty "
          "caption", _as("caption_dropout")),
    Alias("model_type", "(lora)", "lora; full is refused", _one_of("model_type", ("lora",), "this pack trains LoRAs")),
    Alias("flow_schedule_shift", "flow_shift", "a static shift > 0 (it wins over flow_schedule_auto_shift, as "
          "SimpleTuner applies them); 0: none, or auto with flow_schedule_auto_shift", dict),
    Alias("flow_schedule_auto_shift", "flow_shift", "true: auto, the family's own resolution-dependent shift "
          "(SimpleTuner takes Flux's calculate_shift for every family); set without flow_schedule_shift it trains "
          "auto here, where SimpleTuner's static default 3.0 would win (it applies a shift > 0 first)", dict),
    Alias("flow_use_uniform_schedule", "timestep_sampling", "true: uniform", uniform_schedule),
    Alias("flow_sigmoid_scale", "logit_std", "the logit-normal draw's scale", _as("logit_std")),
    Alias("flux_guidance_value", "guidance_value", "the guidance a distilled model trains at", _as("guidance_value")),
    Alias("lycoris_config", "lora_type, lora_rank, lora_alpha, lokr_factor, lokr_full_matrix", "with lora_type "
          "lycoris: a LyCORIS JSON file's algo (lokr, loha), linear_dim, linear_alpha, factor, full_matrix "
          "(per-module factors are refused); without it SimpleTuner's config/lycoris_config.json; other lora_types "
          "do not read it",
          lambda value: {}),
    Alias("weighting_scheme", "timestep_sampling, loss_weighting", "diffusers' scripts: logit_normal, mode: that "
          "sampling; sigma_sqrt, cosmap: uniform sampling with that weighting; none: uniform", weighting_scheme,
          "diffusers"),
    Alias("guidance_scale", "guidance_value", "diffusers' Flux script: the guidance a distilled model trains at",
          _as("guidance_value"), "diffusers"),
)}
"""SimpleTuner keys with a meaning here, by SimpleTuner key; a key of ours given too wins over its alias."""

SAME_KEYS = {
    "learning_rate": "", "lr_scheduler": "constant_with_warmup reads as constant, whose warm-up is lr_warmup_steps",
    "lr_warmup_steps": "", "gradient_accumulation_steps": "", "lora_rank": "", "lora_alpha": "", "lora_dropout": "",
    "lora_type": "standard reads as lora; lycoris reads lycoris_config", "use_dora": "",
    "logit_mean": "diffusers' scripts", "logit_std": "diffusers' scripts", "mode_scale": "diffusers' scripts",
    "seed": "", "resolution": "in pixels, the side of the square", "init_lora": "",
    "mixed_precision": "no reads as fp32, as in accelerate; fp16 and fp8 are refused",
    "base_model_precision": "no_change, int8-torchao, fp8-torchao; the quanto ones are refused",
    "gradient_checkpointing": "true alone: every block", "gradient_checkpointing_interval": "",
    "gradient_checkpointing_segment_stride": "", "gradient_checkpointing_backend": "",
    "gradient_checkpointing_offload_attention": "", "gradient_checkpointing_offload_pin_memory_max_buckets": "",
    "validation_num_inference_steps": "", "max_grad_norm": "",
    "optimizer": "adamw_bf16, optimi-adamw, ao-adamw4bit, ao-adamwfp8 read as adamw (fp32 state); ao-adamw8bit, "
                 "bnb-adamw8bit as adamw8bit; adamw, prodigy alike; the others are refused",
}
"""Keys SimpleTuner and this pack spell alike, with the same meaning (a note where some values differ)."""

IGNORED = {
    "num_train_epochs": "steps are counted, not epochs: set max_train_steps",
    "data_backend_config": "its datasets are not read: set instance_data_dir or data to one image folder",
    "use_ema": "no EMA copy is kept",
    "validation_seed": "previews use seed",
    "validation_resolution": "previews are at the training resolution",
    "validation_guidance": "previews sample without classifier-free guidance",
    "resolution_type": "resolution is in pixels",
    "checkpoints_total_limit": "one resumable state is kept",
    "report_to": "no trackers", "logging_dir": "no trackers", "tracker_project_name": "no trackers",
    "push_to_hub": "nothing is uploaded", "hub_model_id": "nothing is uploaded",
    "framerate": "the frame rate of its validation videos; clips are resampled with frame_rate",
}
"""SimpleTuner keys with no meaning here (ignored with a warning), and why."""

NEEDS = {"num_train_epochs": "steps", "data_backend_config": "data"}
"""Ignored keys whose job would silently change without the key of ours they name: refused unless it is set."""


def flat_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with SimpleTuner's leading ``--`` stripped from every key, and a web-UI file's
    ``{"_metadata": ..., "config": {...}}`` unwrapped to its ``config``.

    Raises:
        ConfigError: a key given twice (with and without the dashes).
    """
    inner = values.get("config")
    if isinstance(inner, Mapping) and all(k == "config" or k.startswith("_") for k in values):
        values = inner
    out: dict[str, Any] = {}
    for key, value in values.items():
        plain = key[2:] if isinstance(key, str) and key.startswith("--") else key
        if plain in out:
            raise ConfigError(f"{key}={value!r} is invalid: {plain!r} is already set ({out[plain]!r}); allowed "
                              "each key once")
        out[plain] = value
    return out


NEAR_MISS_RATIO = 0.8
"""The least ``difflib`` similarity ratio of a near miss (2 x matching characters / all of them)."""
NEAR_MISS_EDITS = 2
"""The most characters of a near miss and the key it misses that do not match: one letter wrong,
two swapped, or one or two missing or extra."""


def near_miss(key: str, spellings: Mapping[str, str]) -> str | None:
    """The key of ours that ``key`` almost spells, else None: the same in lower case with ``-`` as
    ``_``, or a close ``difflib`` match (:data:`NEAR_MISS_RATIO`) that differs in at most
    :data:`NEAR_MISS_EDITS` characters. Chosen so that no SimpleTuner option (its OPTIONS.md and
    configuration registry) is a near miss of ours but those :data:`IGNORED` names.

    Args:
        spellings: ``{a spelling: the key it stands for}``: our keys, the aliases, the flags' names.
    """
    plain = key.lower().replace("-", "_")
    if plain in spellings:
        return spellings[plain]
    for close in difflib.get_close_matches(plain, spellings, n=3, cutoff=NEAR_MISS_RATIO):
        same = sum(block.size for block in difflib.SequenceMatcher(None, plain, close).get_matching_blocks())
        if len(plain) + len(close) - 2 * same <= NEAR_MISS_EDITS:
            return spellings[close]
    return None


def is_simpletuner(values: Mapping[str, Any]) -> bool:
    """Whether flat keys ``values`` are a SimpleTuner config: one of its own keys (an alias of
    SimpleTuner's or a key it ignores here) is set; keys spelled alike say nothing."""
    return any(key in ALIASES and ALIASES[key].peer == "SimpleTuner" or key in IGNORED for key in values)


def read_keys(values: Mapping[str, Any], ours: set[str], spellings: Mapping[str, str] | None = None,
              flow: Callable[[Any], bool] | None = None) -> tuple[dict[str, Any], list[str], list[str]]:
    """Our keys of a config mapping: ``(values by our key, ignored keys, SimpleTuner defaults taken)``.

    Args:
        values: flat keys (:func:`flat_keys` first); a key in ``ours`` is kept as it is, a
            SimpleTuner alias is read by its :class:`Alias` (the flow shift pair and ``lora_type``
            lycoris together, ``recipe.grouped_keys``), a near miss of ours is refused,
            any other key is ignored. A SimpleTuner config (:func:`is_simpletuner`) takes
            SimpleTuner's defaults for the keys it leaves out (``recipe.DEFAULTS``).
        ours: our flat keys and component names.
        spellings: other names that stand for a key of ours (a flag's name: ``{"rank": "lora_rank"}``).
        flow: ``family (None: the default) -> whether it is a flow family``, for the flow defaults.

    Raises:
        ConfigError: an alias's value is refused, two aliases set the same key, an ignored key of
            :data:`NEEDS` without the key it needs, or a near miss of one of our keys (all named
            with their values; a near miss with the key it meant).
    """
    read, ignored = _read(values, ours, spellings or {})
    if not is_simpletuner(values):
        return read, ignored, []
    with_defaults, taken = take_defaults(values, read, bool(flow and flow(read.get("family"))))
    if taken:
        read, ignored = _read(with_defaults, ours, spellings or {})
    return read, ignored, taken


def _read(values: Mapping[str, Any], ours: set[str], spellings: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """:func:`read_keys` without the defaults."""
    grouped, used = grouped_keys(values)
    read = {k: v for k, v in values.items() if k in ours and k not in used}
    from_alias: dict[str, str] = {}
    ignored = []
    for key, value in values.items():
        if key in ours or key in used:
            continue
        if key not in ALIASES:
            _refuse_near_miss(key, value, ours, spellings)
            ignored.append(key)
            continue
        mapped = ALIASES[key].read(value)
        if set(mapped) & set(values):  # a key of ours given too wins over the alias
            ignored.append(key)
            continue
        _merge(read, from_alias, values, key, mapped)
    given = {key for key in grouped if key in values and key not in used}  # ours given too wins
    ignored += sorted(k for k in used if k.startswith("flow_schedule") and "flow_shift" in given)
    _merge(read, from_alias, values, sorted(used)[0] if used else "", {k: v for k, v in grouped.items() if k not in given})
    for key, needed in NEEDS.items():
        if key in values and needed not in read:
            raise ConfigError(f"{key}={values[key]!r} is not read here ({IGNORED[key]}): allowed together with "
                              f"{needed}, or leave it out")
    return read, ignored


def _merge(read: dict[str, Any], from_alias: dict[str, str], values: Mapping[str, Any], key: str,
           mapped: Mapping[str, Any]) -> None:
    """Put an alias's ``mapped`` keys into ``read``.

    Raises:
        ConfigError: two aliases set the same key of ours.
    """
    for target, target_value in mapped.items():
        if target in from_alias:
            raise ConfigError(f"{key}={values.get(key)!r} is invalid with {from_alias[target]}="
                              f"{values[from_alias[target]]!r}: both set {target}; allowed one of them")
        read[target], from_alias[target] = target_value, key


def _refuse_near_miss(key: str, value: Any, ours: set[str], spellings: Mapping[str, str]) -> None:
    """Refuse ``key`` when it almost spells one of ours (:func:`near_miss`); SimpleTuner's keys
    with no meaning here (:data:`IGNORED`) are not ours to correct.

    Raises:
        ConfigError: ``lora_rnak=8 is invalid: not a key of this pack; did you mean lora_rank?``.
    """
    if not isinstance(key, str) or key in IGNORED:
        return
    meant = near_miss(key, {**{k: k for k in (*ours, *ALIASES)}, **spellings})
    if meant is not None:
        via = next((f" (the key of --{s.replace('_', '-')})" for s, k in spellings.items()
                    if k == meant and s == key.lower().replace("-", "_")), "")
        raise ConfigError(f"{key}={value!r} is invalid: not a key of this pack; did you mean {meant}{via}? (allowed "
                          "the keys of segckpt options and the SimpleTuner keys docs/OPTIONS.md lists)")


def describe_ignored(keys: list[str]) -> str:
    """The warning's text for ignored keys: each named, with the reason where :data:`IGNORED` has one."""
    return ", ".join(f"{k} ({IGNORED[k]})" if k in IGNORED else k for k in keys)
