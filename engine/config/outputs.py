"""What a run writes: the output folder, its saves, whether it continues an earlier run, and the
validation previews sampled during it (read by ``engine/train/``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..files.text import clean_text
from .options import ConfigError, check_options, option

LORA_FORMATS = ("both", "comfyui", "diffusers")
"""Which LoRA files a run writes (``engine/model/comfy_lora.py``, ``engine/model/lora_files.py``)."""
ON_DATA_CHANGE = ("refuse", "new_epoch")
"""What a resume does when the data differ from the saved run's (``engine/data/fingerprint.py``)."""
STATE_FILE = "training_state.safetensors"
"""The resumable training state in ``output`` (``engine/train/state.py``): a run there to continue
(``resume``) or to keep (refused without ``overwrite``)."""


@dataclass(frozen=True)
class OutputConfig:
    """The output folder and its saves. Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    output: str = option("output", "Output folder: LoRA, resumable training state, report.json, latent cache.",
                         "--output")
    resume: bool = option(False, "Continue from the training state in the output folder (the options that shape "
                          "the run must match it; steps, schedule, device and saving options may change).",
                          "--resume", long_run=True)
    overwrite: bool = option(False, "Replace a finished or interrupted run in the output folder (otherwise "
                             "refused).", "--overwrite", long_run=True)
    on_data_change: str = option("refuse", "When resuming finds the data changed (images added, removed or "
                                 "recaptioned since the state was saved): refuse (the saved epoch position would "
                                 "skip or repeat images), or new_epoch (continue with a fresh epoch order; the "
                                 "report records the change).", "--on-data-change", choices=ON_DATA_CHANGE,
                                 long_run=True)
    lora_format: str = option("both", "LoRA file names: comfyui (the family's released layout, what ComfyUI's "
                              "LoraLoaderModelOnly applies; fused q/k/v as one exact LoRA), diffusers (transformer.* "
                              "keys, what diffusers' load_lora_weights reads), or both (the diffusers file, and the "
                              "ComfyUI one beside it as <name>_comfyui.safetensors). Families without a ComfyUI "
                              "layout write the diffusers file only (see segckpt families).", "--lora-format",
                              choices=LORA_FORMATS, long_run=True)
    save_every: int = option(0, "Also save the resumable state every N steps (0 = only at the end or on "
                             "interruption).", "--save-every", min=0, max=10**8, long_run=True)

    def __post_init__(self) -> None:
        check_options(self)


MAX_PROMPTS = 16


def _prompts(value: Any) -> Any:
    """``validation_prompts``: one prompt, up to :data:`MAX_PROMPTS` prompts, or unset; each cleaned
    as captions are (``engine/files/text.py`` ``clean_text``: invisible characters removed, NFC), so
    a prompt equal to a caption on screen is the caption."""
    prompts = (value,) if isinstance(value, str) else value
    if prompts is not None and not (isinstance(prompts, (list, tuple)) and 0 < len(prompts) <= MAX_PROMPTS
                                    and all(isinstance(p, str) for p in prompts)):
        raise ConfigError(f"validation_prompts={value!r} is invalid: allowed up to {MAX_PROMPTS} prompts (strings), "
                          "or unset.")
    return tuple(clean_text(p) for p in prompts) if prompts is not None else None


@dataclass(frozen=True)
class ValidationConfig:
    """Preview images sampled with the LoRA being trained. Validated at construction.

    Raises:
        ConfigError: a field is out of range.
    """

    validation_every: int = option(0, "Every N steps (and at the last), sample one small image per validation "
                                   "prompt with the LoRA being trained, saved under previews/ beside the report "
                                   "(0 = off; flow-matching families).", "--validation-every", min=0, max=10**6)
    validation_prompts: tuple[str, ...] | None = option(None, "Prompts of the previews (default: the first caption "
                                                        "of the data).", "--validation-prompt", parse=_prompts)
    validation_num_inference_steps: int = option(8, "Sampler steps per preview (flow-matching Euler); SimpleTuner's "
                                                 "key (its validation_steps is validation_every).",
                                                 "--validation-inference-steps", min=1, max=1000)
    validation_frames: int | None = option(None, "Pixel frames of a video family's preview clip (an animated WebP); "
                                           "the family's frame rule applies; unset: the smallest count above 1 "
                                           "(Wan: 5, LTX-Video: 9). Image families write PNGs.",
                                           "--validation-frames", min=1, max=1024)

    def __post_init__(self) -> None:
        check_options(self)
