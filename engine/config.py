"""The training configuration: one validated object; every field documented once in :data:`HELP`.

:data:`HELP` feeds the CLI's ``--help`` and the node tooltips. A JSON config file may use these
field names, the SimpleTuner names listed in :data:`ALIASES`, and the six schedule keys of
:mod:`.schedule`; unknown keys are reported and ignored (SimpleTuner configs hold many more).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from .attention_kernels import parse_attention_backend
from .lora_io import LoraSettings
from .nonfinite import POLICIES as NONFINITE_POLICIES
from .precision import BASE_PRECISIONS
from .schedule import KEYS as SCHEDULE_KEYS
from .schedule import CheckpointSchedule

LR_SCHEDULERS = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")

DEMO_SCHEDULE = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
"""The built-in default's schedule: checkpoint blocks 0-1, run 2-3 plainly, checkpoint 4-5, ..."""

HELP = {
    "family": "Model family (flux, sd3, pixart, wan, sana, qwenimage, zimage, lumina2, ...).",
    "preset": "Tiny random-init preset used when no model path is given (tests, the demo).",
    "model_path": "Local diffusers folder (pipeline with transformer/ and vae/, or a transformer). Never downloaded.",
    "vae_path": "Local diffusers VAE folder, when model_path is a bare transformer folder.",
    "text_encoder_path": "Local transformers text encoder folder; default: the deterministic word embedder.",
    "data": "Folder of images with same-name .txt captions; default: built-in sample photographs.",
    "resolution": "Square training resolution in pixels (centre crop + resize); a multiple of 16.",
    "steps": "Optimizer steps to train (total, including steps done before a resume).",
    "batch_size": "Images per micro-batch.",
    "gradient_accumulation_steps": "Micro-batches per optimizer step.",
    "learning_rate": "AdamW learning rate (peak, after warm-up).",
    "lr_scheduler": "Learning-rate schedule after warm-up: constant, linear (to 0) or cosine (to 0).",
    "lr_warmup_steps": "Steps of linear learning-rate warm-up from 0.",
    "weight_decay": "AdamW decoupled weight decay.",
    "seed": "Seed of the model init, data order, noise and timesteps.",
    "lora_rank": "LoRA rank r.",
    "lora_alpha": "LoRA alpha; the update is scaled by alpha / rank.",
    "lora_dropout": "LoRA dropout probability.",
    "lora_target_modules": "Module names to adapt (default: the family's attention projections).",
    "output": "Output folder: LoRA, resumable training state, report.json, latent cache.",
    "resume": "Continue from the training state in the output folder (the options that shape the "
              "run must match it; steps, schedule, device and saving options may change).",
    "overwrite": "Replace a finished or interrupted run in the output folder (otherwise refused).",
    "device": "auto (CUDA when available), cpu or cuda.",
    "mixed_precision": "auto (bf16 autocast on CUDA, fp16 for an fp16 base; on the CPU fp32, or the autocast "
                       "of a bf16/fp16 base), bf16 or fp32.",
    "base_model_precision": "Frozen base weights: auto (bf16 on CUDA, fp32 on the CPU), bf16, fp16, fp32, "
                            "int8-torchao or fp8-torchao (Linear weights quantized weight-only through torchao), "
                            "no_change (the dtype the weight files hold). LoRA and optimizer state stay fp32.",
    "attention_backend": "SDPA kernels for forward, backward and every recompute: auto (flash, efficient, math; "
                         "cuDNN is left out because its fused backward returns NaN on some shapes) or a "
                         "comma-separated list of flash, efficient, math, cudnn in priority order.",
    "on_nonfinite": "When the loss or a LoRA gradient is NaN/inf: stop (keep the last good step's LoRA and "
                    "state, exit status 2) or skip (drop that step's update, report it, go on).",
    "save_every": "Also save the resumable state every N steps (0 = only at the end or on interruption).",
    "timing_warmup_steps": "Steps excluded from the sec/step figure (warm-up).",
}

ALIASES = {
    "model_family": "family",
    "pretrained_model_name_or_path": "model_path",
    "instance_data_dir": "data",
    "max_train_steps": "steps",
    "train_batch_size": "batch_size",
    "output_dir": "output",
    "adam_weight_decay": "weight_decay",
}


RESUME_KEYS = ("family", "preset", "model_path", "vae_path", "text_encoder_path", "data", "resolution",
               "batch_size", "gradient_accumulation_steps", "seed", "lora", "learning_rate",
               "lr_scheduler", "lr_warmup_steps", "weight_decay")
"""Options a resumed run must share with the saved one (they shape the model, data and optimizer)."""


class ConfigError(ValueError):
    """A training option is invalid; the message names the key, the value and what is allowed."""


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


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class TrainConfig:
    """A LoRA training run; see :data:`HELP` for every field. Validated at construction.

    Raises:
        ConfigError: a field is out of range; the message names the key, value and what is allowed.
        ScheduleError / LoraConfigError: from the nested schedule and LoRA settings.
    """

    family: str = "flux"
    preset: str = "tiny"
    model_path: str | None = None
    vae_path: str | None = None
    text_encoder_path: str | None = None
    data: str | None = None
    resolution: int = 256
    steps: int = 20
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    seed: int = 0
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(rank=16, alpha=16.0))
    schedule: CheckpointSchedule = DEMO_SCHEDULE
    output: str = "output"
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    mixed_precision: str = "auto"
    base_model_precision: str = "auto"
    attention_backend: str = "auto"
    on_nonfinite: str = "stop"
    save_every: int = 0
    timing_warmup_steps: int = 2

    def __post_init__(self) -> None:
        from .families import family_names, get_family
        from .plan import check_supported

        for key in ("family", "preset", "output"):
            _need(isinstance(getattr(self, key), str) and getattr(self, key) != "", key, getattr(self, key),
                  "a non-empty string")
        for key in ("model_path", "vae_path", "text_encoder_path", "data"):
            _need(getattr(self, key) is None or isinstance(getattr(self, key), str), key, getattr(self, key),
                  "a folder path (string) or unset")
        for key in ("resume", "overwrite"):
            _need(isinstance(getattr(self, key), bool), key, getattr(self, key), "true or false")
        _need(self.family.lower() in family_names(), "family", self.family, ", ".join(family_names()))
        from .loading import PRESETS

        _need(self.preset in PRESETS, "preset", self.preset, ", ".join(PRESETS))
        check_supported(get_family(self.family), self.schedule)
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
        _need(_int(self.save_every) and self.save_every >= 0, "save_every", self.save_every, "an integer >= 0")
        _need(_int(self.timing_warmup_steps) and self.timing_warmup_steps >= 0, "timing_warmup_steps",
              self.timing_warmup_steps, "an integer >= 0")

    def check_paths(self) -> None:
        """Check paths, device and saved state before any heavy work.

        Raises:
            ConfigError: a path does not exist; ``device=cuda`` without CUDA; ``resume`` without a
                saved state or with options that differ from it (:data:`RESUME_KEYS`), or fewer
                steps than already done; a run already in ``output`` without ``resume`` or
                ``overwrite`` (nothing a user made is replaced silently).
        """
        import torch

        from .state import STATE_FILE, read_state_header

        for key in ("model_path", "vae_path", "text_encoder_path", "data"):
            value = getattr(self, key)
            _need(value is None or Path(value).is_dir(), key, value, "an existing folder")
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
        for key in RESUME_KEYS:
            if saved.get(key) != now.get(key):
                raise ConfigError(f"resume: {key}={now.get(key)!r} differs from the saved run's "
                                  f"{saved.get(key)!r}; allowed the saved value (or train into another output)")
        _need(self.steps >= header["step"], "steps", self.steps,
              f"at least the {header['step']} steps already done in {self.output}")

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
            elif key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"):
                name = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
                        "lora_target_modules": "target_modules"}[key]
                if key == "lora_target_modules" and isinstance(value, str):
                    value = [value]
                lora[name] = tuple(value) if key == "lora_target_modules" and value is not None else value
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
