"""Validation previews during a run (read by ``engine/train/previews.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..files.text import clean_text
from .options import ConfigError, check_options, option

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
