"""The configuration of a training run: a small tree of component configs, flat keys outside.

:class:`TrainConfig` holds one config per component (model, data, LoRA, optimizer, objective,
checkpoint schedule, guardrails, outputs, sharding, validation) and the run's own steps and seed; each
component validates its own fields from their metadata (:func:`~.options.check_options`) and this
root checks the rules that span components. Outside, an option is one flat key (the JSON key,
the node input, the ``segckpt`` flag's destination): :data:`OPTIONS` lists them, in the tree's
order, and :meth:`TrainConfig.from_dict` / :meth:`TrainConfig.to_dict` map flat keys to the tree
and back, so config files, ``report.json`` and the saved state keep their flat keys. A config
file may also use SimpleTuner's keys (:data:`~.peers.simpletuner.ALIASES`).
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..families import get_family
from ..files.text import TextFileError, read_text, unique_keys
from .data import DataConfig
from .guardrails import GuardrailsConfig
from .lora import LoraSettings
from .model import ModelConfig
from .objective import ObjectiveConfig, check_objective
from .optim import LR_SCHEDULES, OptimizerConfig
from .options import ConfigError, ConfigWarning, Option, check_options, option, options_of
from .outputs import OutputConfig, ValidationConfig
from .peers.simpletuner import describe_ignored, flat_keys, read_keys
from .schedule import CheckpointSchedule, check_supported, coerce_key
from .sharding import ShardingConfig

SEED_RANGE = 2**64
"""Seeds are integers in [0, 2**64), the range ComfyUI's seed widgets give; seeds derived from a
run's seed (``seed + 1``, ``seed + epoch``) wrap around (:func:`derived_seed`)."""

DEMO_SCHEDULE = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
"""The built-in default's schedule: checkpoint blocks 0-1, run 2-3 plainly, checkpoint 4-5, ..."""

NO_GUARDRAILS = GuardrailsConfig(on_oom="stop", watchdog_slowdown=0)
"""What a run without guardrails (``guardrails=None``) does: no pre-flight, no watchdog, an
out-of-memory error or a non-finite value ends it."""

RESUME_KEYS = ("family", "preset", "model_path", "model_file", "vae_path", "text_encoder_path", "data", "init_lora",
               "resolution", "buckets", "gradient_accumulation_steps", "seed", "lora", "learning_rate",
               "lr_scheduler", "lr_warmup_steps", "weight_decay", "optimizer", "max_grad_norm", "caption_dropout",
               "timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift", "loss_weighting", "snr_gamma",
               "guidance_value")
"""Options a resumed run must share with the saved one (they shape the model, data and optimizer);
the batch must be the same global batch (``engine/train/checks.py``), however many processes share it."""
SAVED_BEFORE = {"flow_shift": "1.0", "max_grad_norm": 0.0}
"""What a run saved before a resume key existed ran with, where that is not the key's default now (a
state saved before ``flow_shift`` drew its noise levels unshifted; one saved before ``max_grad_norm``
did not clip its gradients)."""

NESTED = ("lora", "schedule")
"""Components whose keys :meth:`TrainConfig.to_dict` nests under their name (as ``report.json`` has
always written them); the other components' keys are flat."""


def derived_seed(seed: int, offset: int) -> int:
    """``seed + offset`` within the seed range (it wraps around at 2**64)."""
    return (seed + offset) % SEED_RANGE


@dataclass(frozen=True)
class TrainConfig:
    """A LoRA training run: the component configs and the run's own steps and seed. Validated at
    construction (each component checks itself; the rules across components are checked here).

    Build one from flat keys with :meth:`create` or :meth:`from_dict`; change flat keys with
    :meth:`replace`.

    Raises:
        ConfigError: a field is out of range, or options that cannot run together (the message
            names the key, the value and what is allowed).
        ScheduleError: the family cannot run the schedule.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    schedule: CheckpointSchedule = DEMO_SCHEDULE
    guardrails: GuardrailsConfig | None = field(default_factory=GuardrailsConfig)
    outputs: OutputConfig = field(default_factory=OutputConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    steps: int = option(20, "Optimizer steps to train (total, including steps done before a resume).", "--steps",
                        min=1, max=10**8, long_run=True)
    seed: int = option(0, "Seed of the model init, data order, noise and timesteps.", "--seed", min=0,
                       max=SEED_RANGE - 1)
    timing_warmup_steps: int = option(2, "Steps excluded from the sec/step figure (warm-up).",
                                      "--timing-warmup-steps", min=0, max=10**6, long_run=True)
    ignored_keys: tuple[str, ...] = field(default=(), compare=False)
    """The config file's keys that mean nothing here (:meth:`from_json_file`); not an option."""
    simpletuner_defaults: tuple[str, ...] = field(default=(), compare=False)
    """SimpleTuner's defaults taken for the keys its config file left out (``key=value``;
    ``engine/config/peers/recipe.py``); not an option."""

    def __post_init__(self) -> None:
        check_options(self)
        family = get_family(self.model.family)
        check_supported(family, self.schedule)
        check_objective(self.objective, family)
        if self.data.buckets and not family.aspect_buckets:
            raise ConfigError(f"buckets=True is invalid: allowed false for family {family.name!r}: its latents are "
                              "not an image grid, so aspect ratios do not apply.")
        if self.sharding.fsdp:
            self._check_fsdp()
        if self.sharding.ddp and self.guards.memory_budget is not None:
            raise ConfigError(f"memory_budget={self.guards.memory_budget!r} is invalid: allowed unset with ddp (the "
                              "pre-flight probes one process, and every rank must run the same schedule; run segckpt "
                              "plan --check on one device first and pass the schedule it picks).")
        lora = self.lora
        if self.model.model_file and self.model.model_file.lower().endswith(".gguf") and (
                lora.lora_type != "lora" or lora.use_dora):
            key, value = ("use_dora", True) if lora.use_dora else ("lora_type", lora.lora_type)
            raise ConfigError(f"{key}={value!r} is invalid with a GGUF model_file ({self.model.model_file!r}): allowed "
                              f"{'false' if lora.use_dora else 'lora'} (peft's {value if key == 'lora_type' else 'DoRA'}"
                              " reads the base weight whole, and a GGUF weight stays quantized); or a .safetensors "
                              "model file.")

    def _check_fsdp(self) -> None:
        """What runs sharded (docs/MULTI_GPU.md): refused here, before any process group."""
        base = self.model.base_model_precision
        if base.endswith("-torchao") or base == "fp16":
            raise ConfigError(f"base_model_precision={base!r} is invalid: allowed bf16, fp32, no_change or auto with "
                              "fsdp (torchao's quantized weights are not sharded here, and fp16's loss scaling is "
                              "not wired for sharded gradients).")
        if self.model.model_file and self.model.model_file.lower().endswith(".gguf"):
            raise ConfigError(f"fsdp=True is invalid with a GGUF model_file ({self.model.model_file!r}): allowed false "
                              "(its quantized weights are not sharded here); or a .safetensors model file.")
        if self.schedule.gradient_checkpointing_offload_attention:
            raise ConfigError("gradient_checkpointing_offload_attention=True is invalid: allowed false with fsdp (it "
                              "would copy the blocks' all-gathered weights to host memory); the unsloth backends, "
                              "which offload only the hidden states between blocks, run sharded.")
        if self.schedule.gradient_checkpointing_save_attention and self.sharding.fsdp_activation_checkpointing:
            raise ConfigError("gradient_checkpointing_save_attention=True is invalid with "
                              "fsdp_activation_checkpointing=True: allowed false (FSDP's checkpoint_wrapper recomputes "
                              "whole blocks); with fsdp_activation_checkpointing false the segment runner keeps them")
        if self.optimizer.name != "adamw":
            raise ConfigError(f"optimizer={self.optimizer.name!r} is invalid: allowed adamw with fsdp (only a state "
                              "whose slots have their parameter's shape is gathered for saving and sharded again on "
                              "resume here; 8-bit, factored and flattened slots are not).")
        if self.schedule.streams:
            raise ConfigError("weight_offload='stream' is invalid: allowed none with fsdp (FSDP already shards the "
                              "frozen weights over the processes and gathers each block's before it runs).")
        if self.data.buckets:
            raise ConfigError("buckets=True is invalid: allowed false with fsdp (a bucket's short batch would not "
                              "split evenly over the processes).")
        if self.guards.memory_budget is not None:
            raise ConfigError(f"memory_budget={self.guards.memory_budget!r} is invalid: allowed unset with fsdp (the "
                              "pre-flight probes one process; run segckpt plan --check on one device first).")

    @property
    def guards(self) -> GuardrailsConfig:
        """The guardrails in force: :attr:`guardrails`, or :data:`NO_GUARDRAILS` when it is None."""
        return self.guardrails if self.guardrails is not None else NO_GUARDRAILS

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON-ready form: every option by its key (the LoRA settings and the schedule
        keys nested under ``lora`` and ``schedule``), as config files, ``report.json`` and the
        resumable state hold it. A run without guardrails gives :data:`NO_GUARDRAILS`' values."""
        values: dict[str, Any] = {}
        for opt in options_for(type(self)):
            if opt.path[0] not in NESTED:
                values[opt.key] = _read(self, opt)
        values["lora"], values["schedule"] = asdict(self.lora), self.schedule.to_dict()
        return values

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy with some flat keys (or whole components, by their field name) changed.

        Raises:
            ConfigError: an unknown key; see the class for invalid values.
        """
        config, unknown = self.from_dict(changes, self)
        if unknown:
            raise ConfigError(f"{unknown[0]}={changes[unknown[0]]!r} is invalid: allowed the keys of "
                              f"segckpt options (unknown key {unknown[0]!r}).")
        return config

    @classmethod
    def create(cls, **options: Any) -> "TrainConfig":
        """The defaults with some flat keys (or components) set: ``TrainConfig.create(family="sd3", steps=5)``.

        Raises:
            ConfigError: see :meth:`replace`.
        """
        return cls().replace(**options)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: "TrainConfig | None" = None) -> tuple["TrainConfig", list[str]]:
        """Build from a mapping of flat keys, SimpleTuner's keys (with or without their leading
        ``--``; ``engine/config/peers/simpletuner.py``), schedule keys and whole components (by field name).

        Returns:
            ``(config, ignored_keys)``.

        Raises:
            ConfigError, ScheduleError, LoraConfigError: an invalid value; a key that is a near miss
                of one of ours (``lora_rnak``: "did you mean lora_rank?", ``engine/config/peers/simpletuner.py``).
        """
        base = base or cls()
        by_key = {opt.key: opt for opt in options_for(cls)}
        # a component's field name may also be a flat key ("optimizer": the component, or its name)
        components = {f.name for f in fields(cls) if not f.metadata.get("option") and f.name not in NOT_OPTIONS}
        changes: dict[str, dict[str, Any]] = {}
        whole: dict[str, Any] = {}
        values = flat_keys(values)
        for key, value in values.items():
            if key in components and (is_dataclass(value) or key == "guardrails" and value is None):
                whole[key] = value
        flags = {opt.cli.lstrip("-").replace("-", "_"): opt.key for opt in by_key.values()
                 if opt.cli is not None and opt.type is not bool}  # a bool's flag may say the opposite
        values, ignored, taken = read_keys({k: v for k, v in values.items() if k not in whole}, set(by_key), flags,
                                           flow=lambda name: _flow_family(name or base.model.family))
        for key, value in values.items():
            opt = by_key[key]
            value = _number(opt, value)
            group = opt.path[0] if len(opt.path) > 1 else ""
            changes.setdefault(group, {})[opt.path[-1]] = value
        config = _apply(base, whole, changes)
        return (replace(config, simpletuner_defaults=tuple(taken)) if taken else config), ignored

    @classmethod
    def from_json_file(cls, path: str | Path,
                       base: "TrainConfig | None" = None) -> tuple["TrainConfig", dict[str, Any]]:
        """:meth:`from_dict` on a JSON config file (ours, or SimpleTuner's: ``--`` keys, its web UI's
        wrapper; ``engine/config/peers/simpletuner.py``). The keys it ignores are named in one
        :class:`~.options.ConfigWarning` and kept in the config's :attr:`ignored_keys` (the report's
        ``ignored_config_keys``).

        Returns:
            ``(config, keys)``: the config, and the file's keys as ours (what it set).

        Raises:
            ConfigError: the file cannot be read, is not a JSON object, or sets no key this pack
                reads (it would run the default job); see :meth:`from_dict` for invalid values.
        """
        values = flat_keys(read_config_file(path))
        config, ignored = cls.from_dict(values, base)
        if len(ignored) == len(values):
            shown = ", ".join(sorted(map(str, values))[:8]) + (", ..." if len(values) > 8 else "")
            raise ConfigError(f"config={str(path)!r} is invalid: it sets no key this pack reads ({shown or 'no key'}); "
                              "allowed our keys (segckpt options) and the SimpleTuner keys docs/OPTIONS.md lists")
        if ignored:
            warnings.warn(f"config {path}: ignored keys (no meaning here): {describe_ignored(ignored)}",
                          ConfigWarning, stacklevel=2)
        if config.simpletuner_defaults:
            warnings.warn(f"config {path} is read as SimpleTuner's: its defaults are taken for the keys it leaves "
                          f"out (docs/OPTIONS.md \"SimpleTuner configs\"): {', '.join(config.simpletuner_defaults)}",
                          ConfigWarning, stacklevel=2)
        keys = read_keys(values, {opt.key for opt in options_for(cls)},
                         flow=lambda name: _flow_family(name or (base or cls()).model.family))[0]
        return replace(config, ignored_keys=tuple(ignored)), keys


NOT_OPTIONS = ("ignored_keys", "simpletuner_defaults")
"""Fields of :class:`TrainConfig` that record how a file was read (neither options nor components)."""


def _flow_family(name: Any) -> bool:
    """Whether ``name`` is a flow family (an unknown one is refused later, by the family check)."""
    try:
        return get_family(str(name)).objective == "flow"
    except KeyError:
        return False


def _number(opt: Option, value: Any) -> Any:
    """A number written as a string (``"1e-4"``, ``"1024"``: SimpleTuner's CLI-style files write
    them so) read as the number an int or float option takes; any other value unchanged (the
    option's own check then names it)."""
    if not isinstance(value, str) or opt.type not in (int, float) or opt.meta["parse"] is not None:
        return value
    try:
        number = float(value.strip())
    except ValueError:
        return value
    if opt.type is int:
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else value
    return number


def _read(config: TrainConfig, opt: Option) -> Any:
    """The value of ``opt`` in ``config`` (a run without guardrails reads :data:`NO_GUARDRAILS`)."""
    value: Any = config
    for name in opt.path:
        value = getattr(value, name) if value is not None else getattr(NO_GUARDRAILS, name)
    return value


def _apply(base: TrainConfig, whole: dict[str, Any], changes: dict[str, dict[str, Any]]) -> TrainConfig:
    """``base`` with whole components replaced and flat keys changed, validated once."""
    root = {**whole, **changes.pop("", {})}
    for group, values in changes.items():
        current = whole.get(group, getattr(base, group))
        if group == "schedule":
            if "gradient_checkpointing_interval" in values:
                # A new interval alone means "every block, in groups of N": the base's stride (the
                # demo's 4) is not carried over to a width it was not chosen for.
                values.setdefault("gradient_checkpointing_segment_stride", None)
            elif "gradient_checkpointing_segment_stride" not in values and \
                    coerce_key("gradient_checkpointing", values.get("gradient_checkpointing")) is True:
                # SimpleTuner's gradient_checkpointing: true alone checkpoints every block, not the demo's pattern
                values.update(gradient_checkpointing_interval=None, gradient_checkpointing_segment_stride=None)
            if values.get("weight_offload") == "none":  # streaming off: its count and prefetch go with it
                values.setdefault("weight_offload_blocks", None)
                values.setdefault("weight_offload_prefetch", 1)
            root[group] = CheckpointSchedule.from_config({**current.to_dict(), **values})
        elif group == "guardrails" and current is None:
            root[group] = GuardrailsConfig(**values)
        else:
            root[group] = replace(current, **values)
    return replace(base, **root)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 (or UTF-16 with a byte-order mark) JSON
            (``engine/files/text.py``), gives a key twice in one object (named), or is not an object.
    """
    try:  # decoded as a caption is: UTF-8 with or without a byte-order mark, UTF-16 with one
        data = json.loads(read_text(path, "config"), object_pairs_hook=unique_keys)
    except TextFileError as exc:  # names the file and the byte
        raise ConfigError(str(exc)) from exc
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"config={str(path)!r} could not be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config={str(path)!r} is invalid: allowed a JSON object.")
    return data


def warn_resume_schedule(config: TrainConfig, saved_steps: int | None, done: int) -> None:
    """Warn when a resumed run with a decaying learning rate (``LRSchedule.decays``,
    ``engine/config/optim.py``) changes its total steps."""
    if LR_SCHEDULES[config.optimizer.lr_scheduler].decays and saved_steps != config.steps:
        warnings.warn(
            f"resume: steps={config.steps} differs from the saved run's {saved_steps}, and lr_scheduler="
            f"{config.optimizer.lr_scheduler} decays over the whole run: steps 1-{done} were taken on the "
            f"{saved_steps}-step schedule, the rest follow the {config.steps}-step one (the rate jumps); keep "
            f"steps={saved_steps} for the original schedule", ConfigWarning, stacklevel=3)


@functools.cache
def options_for(cls: type) -> tuple[Option, ...]:
    """Every option of the run config class ``cls`` (:class:`TrainConfig`, or a variant of it), in
    the tree's order (:func:`~.options.options_of`)."""
    return tuple(options_of(cls))


OPTIONS: tuple[Option, ...] = options_for(TrainConfig)
"""Every option of a run, in the tree's order: one flat key each (see :class:`~.options.Option`)."""


def option_named(key: str, options: tuple[Option, ...] = OPTIONS) -> Option:
    """The :class:`~.options.Option` of flat ``key`` among ``options``.

    Raises:
        KeyError: no option has that key.
    """
    for opt in options:
        if opt.key == key:
            return opt
    raise KeyError(f"no option {key!r}")
