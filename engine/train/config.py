"""The training configuration: one validated object; every field documented once, in its metadata.

Each field's help text and ``segckpt`` option sit beside its default (:func:`option`); the CLI
builds its options from them and :data:`HELP` (the node tooltips) collects the texts. A JSON config file may use these
field names, the SimpleTuner names listed in :data:`ALIASES`, and the six schedule keys of
:mod:`.schedule`; unknown keys are reported and ignored (SimpleTuner configs hold many more).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from ..core.memory import check_budget
from ..core.plan import check_supported
from ..core.schedule import KEYS as SCHEDULE_KEYS
from ..core.schedule import CheckpointSchedule
from ..families import family_names, get_family
from .attention_kernels import parse_attention_backend
from .file_checks import check_safetensors
from .loading import PRESETS
from .lora_io import CONFIG_KEYS as LORA_KEYS
from .lora_io import HELP as LORA_HELP
from .lora_io import LoraSettings
from .nonfinite import POLICIES as NONFINITE_POLICIES
from .precision import BASE_PRECISIONS
from .recovery import ON_OOM
from .state import STATE_FILE, read_state_header

LR_SCHEDULERS = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")

DEMO_SCHEDULE = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
"""The built-in default's schedule: checkpoint blocks 0-1, run 2-3 plainly, checkpoint 4-5, ..."""

def option(default: Any, help: str, cli: str | None = None, long_run: bool = False) -> Any:
    """A config field documented once: its help text and command-line option live in its metadata.

    Args:
        default: the default value (a callable: a default factory).
        help: the text of ``--help`` and of the node tooltips.
        cli: the ``segckpt`` option (``None``: not an option).
        long_run: an option of ``segckpt train`` only (steps, saving, resuming), not of the
            short measurement runs of ``sweep`` and ``plan``.
    """
    meta = {"help": help, "cli": cli, "long_run": long_run}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


ALIASES = {
    "model_family": "family",
    "pretrained_model_name_or_path": "model_path",
    "instance_data_dir": "data",
    "max_train_steps": "steps",
    "train_batch_size": "batch_size",
    "output_dir": "output",
    "adam_weight_decay": "weight_decay",
}


RESUME_KEYS = ("family", "preset", "model_path", "model_file", "vae_path", "text_encoder_path", "data", "init_lora",
               "resolution", "buckets", "batch_size", "gradient_accumulation_steps", "seed", "lora", "learning_rate",
               "lr_scheduler", "lr_warmup_steps", "weight_decay")
"""Options a resumed run must share with the saved one (they shape the model, data and optimizer)."""


class ConfigError(ValueError):
    """A training option is invalid; the message names the key, the value and what is allowed."""


class ConfigWarning(UserWarning):
    """An option is valid but does something the user may not expect; the message says what."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, or is not an object.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"config={str(path)!r} could not be read as JSON: {exc}") from exc
    _need(isinstance(data, dict), "config", str(path), "a JSON object")
    return data


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: allowed {allowed}.")


def _module_names(value: Any) -> tuple[str, ...] | None:
    """``lora_target_modules`` as a tuple: one name, a list of names, or unset.

    Raises:
        ConfigError: anything else.
    """
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, str):
        return (value,)
    _need(isinstance(value, list), "lora_target_modules", value, "a module name or a list of module names")
    return tuple(value)


def _paths(value: Any) -> tuple[str, ...] | None:
    """``text_encoder_path`` as a tuple of folders: one path, a list of paths, or unset.

    Raises:
        ConfigError: anything else.
    """
    if value is None or value == [] or value == ():
        return None
    values = (value,) if isinstance(value, str) else value
    _need(isinstance(values, (list, tuple)) and all(isinstance(v, str) and v for v in values),
          "text_encoder_path", value, "a folder or a list of folders")
    return tuple(values)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class TrainConfig:
    """A LoRA training run; every field's help and ``segckpt`` option are in its metadata
    (:func:`option`; collected in :data:`HELP`). Validated at construction.

    Raises:
        ConfigError: a field is out of range; the message names the key, value and what is allowed.
        ScheduleError / LoraConfigError: from the nested schedule and LoRA settings.
    """

    family: str = option("flux", "Model family (flux, sd3, pixart, wan, sana, qwenimage, zimage, lumina2, ...).",
                         "--family")
    preset: str = option("tiny", "Tiny random-init preset used when no model path is given (tests, the demo).",
                         "--preset")
    model_path: str | None = option(None, "Local diffusers folder (pipeline with transformer/ and vae/, or a "
                                    "transformer). Never downloaded.", "--model-path")
    model_file: str | None = option(
        None, "One local .safetensors file holding the transformer (ComfyUI's models/diffusion_models, unet or "
        "checkpoints; the original release layout or the diffusers layout); the variant is read from its tensor "
        "shapes. Needs vae_path for image data. Never downloaded.", "--model-file")
    vae_path: str | None = option(None, "Local diffusers VAE folder, when model_path is a bare transformer folder "
                                  "or model_file is set.", "--vae-path")
    text_encoder_path: tuple[str, ...] | None = option(
        None, "Local transformers text encoder folder(s), the ones the family's pipeline uses, each identified by its "
        "config.json (Flux: CLIP-L and T5; SD3: CLIP-L, CLIP-G and T5; Qwen-Image: Qwen2.5-VL; Wan: UMT5); default: "
        "a model folder's text_encoder*/ folders, else the deterministic stand-in word embedder (NOT a language "
        "model: the run warns).", "--text-encoder")
    data: str | None = option(None, "Folder of images with same-name .txt captions; default: built-in sample "
                              "photographs.", "--data")
    resolution: int = option(256, "Square training resolution in pixels (centre crop + resize); a multiple of 16. "
                             "With buckets: the side of the square whose pixel area every bucket keeps.",
                             "--resolution")
    buckets: bool = option(False, "Aspect-ratio buckets: each image is cropped to the bucket of its nearest aspect "
                           "ratio (about resolution x resolution pixels, 1:4 to 4:1, sides in the multiples the "
                           "model needs) instead of the square; a batch never mixes buckets. Image folders only "
                           "(not ComfyUI latents).", "--buckets")
    steps: int = option(20, "Optimizer steps to train (total, including steps done before a resume).", "--steps",
                        long_run=True)
    batch_size: int = option(1, "Images per micro-batch.", "--batch-size")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", "--grad-accum")
    learning_rate: float = option(1e-3, "AdamW learning rate (peak, after warm-up).", "--lr")
    lr_scheduler: str = option("constant", "Learning-rate schedule after warm-up: constant, linear (to 0) or "
                               "cosine (to 0); diffusers' schedules.", "--lr-scheduler")
    lr_warmup_steps: int = option(0, "Steps of linear learning-rate warm-up (step k of W uses k/W of the rate).",
                                  "--lr-warmup-steps")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay.", "--weight-decay")
    seed: int = option(0, "Seed of the model init, data order, noise and timesteps.", "--seed")
    lora: LoraSettings = option(lambda: LoraSettings(rank=16, alpha=16.0), "LoRA settings (see the lora_* keys).")
    schedule: CheckpointSchedule = option(DEMO_SCHEDULE, "The six gradient_checkpointing_* keys.")
    init_lora: str | None = option(None, "Start from the LoRA in this .safetensors file (one this pack saved, or "
                                   "a diffusers/kohya-style file with transformer. keys and the run's rank).",
                                   "--init-lora")
    output: str = option("output", "Output folder: LoRA, resumable training state, report.json, latent cache.",
                         "--output")
    resume: bool = option(False, "Continue from the training state in the output folder (the options that shape "
                          "the run must match it; steps, schedule, device and saving options may change).",
                          "--resume", long_run=True)
    overwrite: bool = option(False, "Replace a finished or interrupted run in the output folder (otherwise "
                             "refused).", "--overwrite", long_run=True)
    device: str = option("auto", "auto (CUDA when available), cpu or cuda.", "--device")
    mixed_precision: str = option("auto", "auto (bf16 autocast on CUDA, fp16 for an fp16 base; on the CPU fp32, "
                                  "or the autocast of a bf16/fp16 base), bf16 or fp32.", "--mixed-precision")
    base_model_precision: str = option(
        "auto", "Frozen base weights: auto (bf16 on CUDA, fp32 on the CPU), bf16, fp16, fp32, int8-torchao or "
        "fp8-torchao (Linear weights quantized weight-only through torchao), no_change (the dtype the weight "
        "files hold). LoRA and optimizer state stay fp32.", "--base-precision")
    attention_backend: str = option(
        "auto", "SDPA kernels for forward, backward and every recompute: auto (flash, efficient, math; cuDNN is "
        "left out because its fused backward returns NaN on some shapes) or a comma-separated list of flash, "
        "efficient, math, cudnn in priority order.", "--attention-backend")
    on_nonfinite: str = option("stop", "When the loss or a LoRA gradient is NaN/inf: stop (keep the last good "
                               "step's LoRA and state, exit status 2) or skip (drop that step's update, report "
                               "it, go on).", "--on-nonfinite")
    memory_budget: str | None = option(
        None, "Memory budget of the pre-flight check: a number of GiB, device (the device's total memory) or free "
        "(its free memory now); before step 1 one probe step per batch shape (and the preview phase) predicts every "
        "phase's peak, and a run predicted not to fit does not start (unless start_anyway). Unset: no pre-flight.",
        "--budget", long_run=True)
    start_anyway: bool = option(False, "Start even when the pre-flight predicts that a phase does not fit the "
                                "memory budget.", "--start-anyway", long_run=True)
    on_oom: str = option("switch", "When a step runs out of memory: switch (keep the last completed step, apply "
                         "the next cheaper checkpoint schedule, retry the step, report the switch) or stop (keep "
                         "the last good step's LoRA and state, exit status 2).", "--on-oom", long_run=True)
    watchdog_slowdown: float = option(1.5, "Report once when steps run this many times slower than the first "
                                      "steps after warm-up (of the same shape) for watchdog_window steps in a row, "
                                      "with the likely cause (0 = off).", "--watchdog-slowdown", long_run=True)
    watchdog_window: int = option(5, "Consecutive slow steps that make a slowdown.", "--watchdog-window",
                                  long_run=True)
    fsdp: bool = option(False, "Shard the model with PyTorch FSDP2 (fully_shard on every block and the root; frozen "
                        "base and LoRA) over the processes torchrun starts: NCCL on CUDA, gloo on the CPU. batch_size "
                        "is the global batch, split evenly over the processes; only rank 0 logs and writes, and the "
                        "LoRA and resumable state are saved whole (a single process can load them).", "--fsdp",
                        long_run=True)
    fsdp_activation_checkpointing: bool = option(
        False, "With fsdp: FSDP-style activation checkpointing (checkpoint_wrapper around every block) instead of "
        "the segmented schedule; the model-level schedule is then switched off, with a warning.",
        "--fsdp-activation-checkpointing", long_run=True)
    save_every: int = option(0, "Also save the resumable state every N steps (0 = only at the end or on "
                             "interruption).", "--save-every", long_run=True)
    validation_every: int = option(0, "Every N steps (and at the last), sample one small image per validation "
                                   "prompt with the LoRA being trained, saved under previews/ beside the report "
                                   "(0 = off; flow-matching families).", "--validation-every")
    validation_prompts: tuple[str, ...] | None = option(None, "Prompts of the previews (default: the first caption "
                                                        "of the data).", "--validation-prompt")
    validation_steps: int = option(8, "Sampler steps per preview (flow-matching Euler).", "--validation-steps")
    timing_warmup_steps: int = option(2, "Steps excluded from the sec/step figure (warm-up).",
                                      "--timing-warmup-steps", long_run=True)

    def __post_init__(self) -> None:
        for key in ("family", "preset", "output"):
            _need(isinstance(getattr(self, key), str) and getattr(self, key) != "", key, getattr(self, key),
                  "a non-empty string")
        for key in ("model_path", "model_file", "vae_path", "data", "init_lora"):
            _need(getattr(self, key) is None or isinstance(getattr(self, key), str), key, getattr(self, key),
                  "a path (string) or unset")
        object.__setattr__(self, "text_encoder_path", _paths(self.text_encoder_path))
        _need(not (self.model_path and self.model_file), "model_file", self.model_file,
              f"unset when model_path is set ({self.model_path!r}): model_path and model_file both name the model, "
              "give one of them")
        for key in ("resume", "overwrite", "buckets"):
            _need(isinstance(getattr(self, key), bool), key, getattr(self, key), "true or false")
        _need(self.family.lower() in family_names(), "family", self.family, ", ".join(family_names()))
        _need(self.preset in PRESETS, "preset", self.preset, ", ".join(PRESETS))
        check_supported(get_family(self.family), self.schedule)
        _need(not self.buckets or get_family(self.family).aspect_buckets, "buckets", self.buckets,
              f"false for family {self.family!r}: its latents are not an image grid, so aspect ratios do not apply")
        _need(_int(self.resolution) and self.resolution >= 16 and self.resolution % 16 == 0,
              "resolution", self.resolution, "a multiple of 16, >= 16")
        _need(_int(self.steps) and self.steps >= 1, "steps", self.steps, "an integer >= 1")
        _need(_int(self.batch_size) and self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        _need(_int(self.gradient_accumulation_steps) and self.gradient_accumulation_steps >= 1,
              "gradient_accumulation_steps", self.gradient_accumulation_steps, "an integer >= 1")
        _need(_number(self.learning_rate) and self.learning_rate > 0,
              "learning_rate", self.learning_rate, "a finite number > 0")
        _need(self.lr_scheduler in LR_SCHEDULERS, "lr_scheduler", self.lr_scheduler, ", ".join(LR_SCHEDULERS))
        _need(_int(self.lr_warmup_steps) and self.lr_warmup_steps >= 0, "lr_warmup_steps",
              self.lr_warmup_steps, "an integer >= 0")
        _need(_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
              self.weight_decay, "a finite number >= 0")
        _need(_int(self.seed) and 0 <= self.seed < 2**63, "seed", self.seed, "an integer in [0, 2**63)")
        _need(_int(self.resolution) and self.resolution <= 8192, "resolution", self.resolution, "at most 8192")
        _need(self.device in DEVICES, "device", self.device, ", ".join(DEVICES))
        _need(self.mixed_precision in PRECISIONS, "mixed_precision", self.mixed_precision, ", ".join(PRECISIONS))
        _need(self.base_model_precision in BASE_PRECISIONS, "base_model_precision", self.base_model_precision,
              ", ".join(BASE_PRECISIONS))
        names = parse_attention_backend(self.attention_backend)
        if not isinstance(self.attention_backend, str):  # a JSON list: kept as its canonical string
            object.__setattr__(self, "attention_backend", ",".join(names))
        _need(self.on_nonfinite in NONFINITE_POLICIES, "on_nonfinite", self.on_nonfinite, ", ".join(NONFINITE_POLICIES))
        if self.memory_budget is not None:
            try:
                object.__setattr__(self, "memory_budget", str(check_budget(self.memory_budget, "memory_budget")))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        _need(isinstance(self.start_anyway, bool), "start_anyway", self.start_anyway, "true or false")
        _need(self.on_oom in ON_OOM, "on_oom", self.on_oom, ", ".join(ON_OOM))
        _need(_number(self.watchdog_slowdown) and (self.watchdog_slowdown == 0 or self.watchdog_slowdown > 1),
              "watchdog_slowdown", self.watchdog_slowdown, "a number > 1, or 0 (off)")
        _need(_int(self.watchdog_window) and self.watchdog_window >= 1, "watchdog_window", self.watchdog_window,
              "an integer >= 1")
        self._check_fsdp()
        _need(_int(self.save_every) and self.save_every >= 0, "save_every", self.save_every, "an integer >= 0")
        _need(_int(self.timing_warmup_steps) and self.timing_warmup_steps >= 0, "timing_warmup_steps",
              self.timing_warmup_steps, "an integer >= 0")
        _need(_int(self.validation_every) and self.validation_every >= 0, "validation_every", self.validation_every,
              "an integer >= 0")
        _need(_int(self.validation_steps) and 1 <= self.validation_steps <= 1000, "validation_steps",
              self.validation_steps, "an integer from 1 to 1000")
        prompts = self.validation_prompts
        if isinstance(prompts, str):
            prompts = (prompts,)
        _need(prompts is None or (isinstance(prompts, (list, tuple)) and 0 < len(prompts) <= 16
                                  and all(isinstance(p, str) for p in prompts)),
              "validation_prompts", self.validation_prompts, "up to 16 prompts (strings), or unset")
        object.__setattr__(self, "validation_prompts", tuple(prompts) if prompts is not None else None)

    def _check_fsdp(self) -> None:
        """What runs sharded (README "Several GPUs"): refused here, before any process group."""
        for key in ("fsdp", "fsdp_activation_checkpointing"):
            _need(isinstance(getattr(self, key), bool), key, getattr(self, key), "true or false")
        _need(self.fsdp or not self.fsdp_activation_checkpointing, "fsdp_activation_checkpointing", True,
              "false without fsdp (it is FSDP's own checkpointing; set fsdp too)")
        if not self.fsdp:
            return
        _need(not self.base_model_precision.endswith("-torchao") and self.base_model_precision != "fp16",
              "base_model_precision", self.base_model_precision, "bf16, fp32, no_change or auto with fsdp "
              "(torchao's quantized weights are not sharded here, and fp16's loss scaling is not wired for "
              "sharded gradients)")
        _need(not self.schedule.gradient_checkpointing_offload_attention, "gradient_checkpointing_offload_attention",
              True, "false with fsdp (it would copy the blocks' all-gathered weights to host memory); the unsloth "
              "backends, which offload only the hidden states between blocks, run sharded")
        _need(not self.buckets, "buckets", True, "false with fsdp (a bucket's short batch would not split evenly "
              "over the processes)")
        _need(self.memory_budget is None, "memory_budget", self.memory_budget, "unset with fsdp (the pre-flight "
              "probes one process; run segckpt plan --check on one device first)")

    def check_input_paths(self) -> None:
        """Check the paths the run reads (model, VAE, text encoder, data, init LoRA) before any
        model is built.

        Raises:
            ConfigError: a folder does not exist; ``model_file`` is not a ``.safetensors`` file,
                or has no ``vae_path`` beside it.
            DamagedFileError: ``model_file`` or ``init_lora`` is truncated or unreadable.
        """
        for key in ("model_path", "vae_path", "data"):
            value = getattr(self, key)
            _need(value is None or Path(value).is_dir(), key, value, "an existing folder")
        for value in self.text_encoder_path or ():
            _need(Path(value).is_dir(), "text_encoder_path", value, "existing folders")
        if self.model_file is not None:
            _need(self.model_file.endswith(".safetensors") and Path(self.model_file).is_file(), "model_file",
                  self.model_file, "an existing .safetensors file (pickle checkpoints are refused: loading one can "
                  "run arbitrary code)")
            check_safetensors(self.model_file, "model_file", "download or copy the file again")
        if self.init_lora is not None and not self.resume:  # a resumed run continues from its state
            check_safetensors(self.init_lora, "init_lora", "give a complete .safetensors LoRA file")

    def check_paths(self) -> None:
        """Check paths (:meth:`check_input_paths`), device and saved state before any heavy work.

        Raises:
            ConfigError: see :meth:`check_input_paths`; ``device=cuda`` without CUDA; ``resume``
                without a saved state or with options that differ from it (:data:`RESUME_KEYS`),
                or fewer steps than already done; a run already in ``output`` without ``resume``
                or ``overwrite`` (nothing a user made is replaced silently).
            DamagedFileError: see :meth:`check_input_paths`.
        """
        self.check_input_paths()
        _need(not Path(self.output).exists() or Path(self.output).is_dir(), "output", self.output, "a folder")
        _need(self.device != "cuda" or torch.cuda.is_available(), "device", self.device,
              "auto or cpu (CUDA is not available here)")
        state = Path(self.output) / STATE_FILE
        if not self.resume:
            _need(self.overwrite or not state.is_file(), "output", self.output,
                  "a folder without a training run: it holds one; pass --resume to continue it or "
                  "--overwrite to replace it")
            return
        _need(state.is_file(), "resume", True, f"only when {state} exists (run without --resume first)")
        header = read_state_header(self.output)
        saved, now = header["config"], json.loads(json.dumps(self.to_dict(), default=str))
        defaults = {f.name: f.default for f in fields(self)}  # a state saved before a key existed ran with its default
        for key in RESUME_KEYS:
            before = saved.get(key, defaults.get(key))
            if before != now.get(key):
                raise ConfigError(f"resume: {key}={now.get(key)!r} differs from the saved run's "
                                  f"{before!r}; allowed the saved value (or start a new run)")
        _need(self.steps >= header["step"], "steps", self.steps,
              f"at least the {header['step']} steps already done in {self.output}")
        saved_steps = saved.get("steps")
        if self.lr_scheduler in ("linear", "cosine") and saved_steps != self.steps:
            warnings.warn(
                f"resume: steps={self.steps} differs from the saved run's {saved_steps}, and lr_scheduler="
                f"{self.lr_scheduler} decays over the whole run: steps 1-{header['step']} were taken on the "
                f"{saved_steps}-step schedule, the rest follow the {self.steps}-step one (the rate jumps); keep "
                f"steps={saved_steps} for the original schedule", ConfigWarning, stacklevel=2)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (schedule keys and LoRA settings nested)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: "TrainConfig | None" = None) -> tuple["TrainConfig", list[str]]:
        """Build from a mapping of field names, SimpleTuner aliases and schedule keys.

        Returns:
            ``(config, ignored_keys)``.

        Raises:
            ConfigError, ScheduleError, LoraConfigError: an invalid value.
        """
        base = base or cls()
        names = {f.name for f in fields(cls)} - {"lora", "schedule"}
        changes: dict[str, Any] = {}
        lora: dict[str, Any] = {}
        schedule: dict[str, Any] = {}
        ignored = []
        for key, value in values.items():
            key = ALIASES.get(key, key)
            if key in SCHEDULE_KEYS:
                schedule[key] = value
            elif key in LORA_KEYS:
                if key == "lora_target_modules":
                    value = _module_names(value)
                lora[LORA_KEYS[key]] = value
            elif key in names:
                changes[key] = value
            else:
                ignored.append(key)
        if "gradient_checkpointing_interval" in schedule:
            # A new interval alone means "every block, in groups of N": the base's stride (the
            # demo's 4) is not carried over to a width it was not chosen for.
            schedule.setdefault("gradient_checkpointing_segment_stride", None)
        if schedule:
            changes["schedule"] = CheckpointSchedule.from_config({**base.schedule.to_dict(), **schedule})
        if lora:
            changes["lora"] = LoraSettings(**{**asdict(base.lora), **lora})
        return replace(base, **changes), ignored

    @classmethod
    def from_json_file(cls, path: str | Path, base: "TrainConfig | None" = None) -> tuple["TrainConfig", list[str]]:
        """:meth:`from_dict` on a JSON file.

        Raises:
            ConfigError: the file cannot be read or is not a JSON object.
        """
        return cls.from_dict(read_config_file(path), base)


HELP = {f.name: f.metadata["help"] for f in fields(TrainConfig)} | LORA_HELP
"""One help text per config key (LoRA keys by their config names): ``--help`` and the node tooltips."""
