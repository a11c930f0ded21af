"""The model a run trains: where its weights come from, the adapter it starts from, where and in
which precision it runs (read by ``engine/model/``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..families import family_names
from .options import ConfigError, check_options, option

PRESETS = ("tiny",)
"""Random-init presets a run can build when no model path is given."""
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")
"""``mixed_precision`` values (the step's compute)."""
BASE_PRECISIONS = ("auto", "bf16", "fp16", "fp32", "int8-torchao", "fp8-torchao", "no_change")
"""``base_model_precision`` values (the frozen base's storage; SimpleTuner's key)."""
QUANTIZED = ("int8-torchao", "fp8-torchao")
ATTENTION_KERNELS = ("flash", "efficient", "math", "cudnn")
"""SDPA kernel names of ``attention_backend`` (torch's ``SDPBackend`` members)."""
AUTO_KERNELS = ("flash", "efficient", "math")
"""``attention_backend=auto``: cuDNN is left out (its fused backward returns NaN on some shapes)."""


class AttentionBackendError(ValueError):
    """An ``attention_backend`` value is invalid; the message names the value and what is allowed."""


def parse_attention_backend(value: Any) -> tuple[str, ...]:
    """Kernel names of an ``attention_backend`` value, in priority order.

    Args:
        value: ``"auto"``, a comma-separated string (``"flash,math"``) or a list of names.

    Raises:
        AttentionBackendError: empty, unknown or repeated names.
    """
    if value == "auto":
        return AUTO_KERNELS
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    allowed = "auto or a comma-separated list of " + ", ".join(ATTENTION_KERNELS)
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise AttentionBackendError(f"attention_backend={value!r} is invalid: allowed {allowed}.")
    unknown = [n for n in names if n not in ATTENTION_KERNELS]
    if unknown or len(set(names)) != len(names):
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "a name is repeated"
        raise AttentionBackendError(f"attention_backend={value!r} is invalid ({what}): allowed {allowed}.")
    return tuple(names)


def _attention(value: Any) -> str:
    """The canonical string of an ``attention_backend`` value (a JSON list is joined)."""
    names = parse_attention_backend(value)
    return value if isinstance(value, str) else ",".join(names)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _mixed_precision(value: Any) -> Any:
    """``mixed_precision``: accelerate's ``no`` (no autocast; SimpleTuner's word too) is ``fp32``."""
    return "fp32" if value == "no" else value


def _folders(value: Any) -> Any:
    """``text_encoder_path``: one folder, a list of folders, or unset (an empty list)."""
    if value is None or value == [] or value == ():
        return None
    values = (value,) if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"text_encoder_path={value!r} is invalid: allowed a folder or a list of folders.")
    return tuple(values)


@dataclass(frozen=True)
class ModelConfig:
    """The model source and how it runs. Validated at construction.

    Raises:
        ConfigError: a field is out of range; ``model_path`` and ``model_file`` are both set; a
            torchao ``base_model_precision`` with a GGUF ``model_file``.
        AttentionBackendError: an invalid ``attention_backend``.
    """

    family: str = option("flux", "Model family (flux, sd3, pixart, wan, sana, qwenimage, zimage, lumina2, ...).",
                         "--family", choices=family_names, parse=_lower)
    preset: str = option("tiny", "Tiny random-init preset used when no model path is given (tests, the demo).",
                         "--preset", choices=PRESETS)
    model_path: str | None = option(None, "Local diffusers folder (pipeline with transformer/ and vae/, or a "
                                    "transformer). Never downloaded.", "--model-path")
    model_file: str | None = option(
        None, "One local .safetensors or .gguf file holding the transformer (ComfyUI's models/diffusion_models, unet "
        "or checkpoints; the original release layout or the diffusers layout; ComfyUI's scaled fp8 files are "
        "dequantized as read, a GGUF file's quantized Linear weights stay quantized and are dequantized per layer); "
        "the variant is read from its tensor shapes. Needs vae_path for image data. Never downloaded.", "--model-file")
    vae_path: str | None = option(None, "Local diffusers VAE folder, when model_path is a bare transformer folder "
                                  "or model_file is set.", "--vae-path")
    text_encoder_path: tuple[str, ...] | None = option(
        None, "Local transformers text encoder folder(s), the ones the family's pipeline uses, each identified by its "
        "config.json (Flux: CLIP-L and T5; SD3: CLIP-L, CLIP-G and T5; Qwen-Image: Qwen2.5-VL; Wan: UMT5); default: "
        "a model folder's text_encoder*/ folders, else the deterministic stand-in word embedder (NOT a language "
        "model: the run warns).", "--text-encoder", parse=_folders)
    init_lora: str | None = option(None, "Start from the LoRA in this .safetensors file (one this pack saved, or "
                                   "a diffusers/kohya-style file with transformer. keys and the run's rank).",
                                   "--init-lora")
    device: str = option("auto", "auto (CUDA when available), cpu or cuda.", "--device", choices=DEVICES)
    mixed_precision: str = option("auto", "auto (bf16 autocast on CUDA, fp16 for an fp16 base; on the CPU fp32, "
                                  "or the autocast of a bf16/fp16 base), bf16 or fp32 (no = fp32, as accelerate and "
                                  "SimpleTuner write it).", "--mixed-precision", choices=PRECISIONS,
                                  parse=_mixed_precision, allowed="auto, bf16, fp32 or no (= fp32)")
    base_model_precision: str = option(
        "auto", "Frozen base weights: auto (bf16 on CUDA, fp32 on the CPU), bf16, fp16, fp32, int8-torchao or "
        "fp8-torchao (Linear weights quantized weight-only through torchao), no_change (the dtype the weight "
        "files hold). LoRA and optimizer state stay fp32.", "--base-precision", choices=BASE_PRECISIONS)
    attention_backend: str = option(
        "auto", "SDPA kernels for forward, backward and every recompute: auto (flash, efficient, math; cuDNN is "
        "left out because its fused backward returns NaN on some shapes) or a comma-separated list of flash, "
        "efficient, math, cudnn in priority order.", "--attention-backend", parse=_attention)
    compile_blocks: bool = option(
        False, "torch.compile each block of the family's block lists once (diffusers' compile_repeated_blocks "
        "where the model declares _repeated_blocks), dynamic shapes, the checkpoint call outside the compiled "
        "block. Not a universal win: measure it (segckpt sweep --compile). Blocks that cannot compile (offload or "
        "streaming hooks, quantized weights, kept attention outputs) stay eager, named in one warning.",
        "--compile-blocks")

    def __post_init__(self) -> None:
        check_options(self)
        if self.model_file and self.model_file.lower().endswith(".gguf") and self.base_model_precision in QUANTIZED:
            raise ConfigError(f"base_model_precision={self.base_model_precision!r} is invalid with a GGUF model_file "
                              f"({self.model_file!r}), whose Linear weights are already quantized and stay so: allowed "
                              "auto, bf16, fp16, fp32 or no_change (the dtype they dequantize to).")
        if self.model_path and self.model_file:
            raise ConfigError(f"model_file={self.model_file!r} is invalid: allowed unset when model_path is set "
                              f"({self.model_path!r}): model_path and model_file both name the model, give one of "
                              "them.")
