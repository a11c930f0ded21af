"""Where a family's training data comes from besides images: ComfyUI latent formats, text encoders.

:class:`LatentFormat` is how ComfyUI turns a VAE's raw latents into the model's input (its
``process_in``); the constants are those of ComfyUI 0.3.64 ``comfy/latent_formats.py``, which
equal the released VAEs' configs (``scaling_factor``, ``shift_factor``, ``latents_mean/std``).
:class:`TextEncoders` names the encoders a family's diffusers pipeline uses and how their outputs
form a :class:`~.base.TextBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .lazy import torch


@dataclass(frozen=True)
class LatentFormat:
    """A ComfyUI latent format: ``process_in(raw) = (raw - shift) * scale``, or per channel
    ``(raw - mean) * scale / std`` when ``mean``/``std`` are given.

    Attributes:
        name: the class in ComfyUI's ``comfy/latent_formats.py``.
        channels: latent channels C.
        scale, shift: ``scale_factor`` and ``shift_factor`` there.
        mean, std: ``latents_mean`` / ``latents_std`` per channel (Wan-style), or ``None``.
        frames: latent frames the family's model reads: ``None`` = any (video), 1 = an image model
            on single-frame video latents (Qwen-Image reads frame 0 only).
    """

    name: str
    channels: int
    scale: float = 1.0
    shift: float = 0.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    frames: int | None = None

    def _stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1) + (1,) * (latents.ndim - 2)  # (1, C, 1, 1) or (1, C, 1, 1, 1)
        mean = torch.tensor(self.mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(self.std, dtype=latents.dtype, device=latents.device).view(shape)
        return mean, std

    def process_in(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents ``(B, C, ...)`` -> the model's normalised latents (same shape)."""
        if self.mean is not None:
            mean, std = self._stats(raw)
            return (raw - mean) * self.scale / std
        return (raw - self.shift) * self.scale

    def process_out(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`process_in`: normalised latents -> raw VAE latents (what a LATENT holds)."""
        if self.mean is not None:
            mean, std = self._stats(latents)
            return latents * std / self.scale + mean
        return latents / self.scale + self.shift

    def one_frame(self) -> LatentFormat:
        """The same format for an image model that reads one latent frame."""
        return replace(self, frames=1)

    def describe(self) -> str:
        """``Flux (scale 0.3611, shift 0.1159)`` or ``Wan21 (per-channel mean/std)``."""
        if self.mean is not None:
            return f"{self.name} (per-channel mean/std, scale {self.scale})"
        return f"{self.name} (scale {self.scale}, shift {self.shift})"


FLUX = LatentFormat("Flux", 16, scale=0.3611, shift=0.1159)
"""``latent_formats.Flux``: Flux.1, Chroma, Lumina 2, HiDream, OmniGen2 (``supported_models.py``)."""
SD3 = LatentFormat("SD3", 16, scale=1.5305, shift=0.0609)
"""``latent_formats.SD3``: SD3 / SD3.5."""
SDXL = LatentFormat("SDXL", 4, scale=0.13025)
"""``latent_formats.SDXL``: the SDXL VAE (AuraFlow, PixArt-Sigma, SDXL)."""
HUNYUAN_VIDEO = LatentFormat("HunyuanVideo", 16, scale=0.476986)
"""``latent_formats.HunyuanVideo``."""
LTXV = LatentFormat("LTXV", 128)
"""``latent_formats.LTXV``: identity; ComfyUI's LTXV VAE normalises by its per-channel statistics
inside ``encode`` (``comfy/ldm/lightricks/vae``), as diffusers' LTX pipeline does after encoding."""
WAN21 = LatentFormat(
    "Wan21", 16,
    mean=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160))
"""``latent_formats.Wan21``: the Wan 2.1 VAE (Wan 2.1, Wan VACE, Qwen-Image's VAE shares its statistics)."""


@dataclass(frozen=True)
class TextEncoders:
    """The text encoders of a family's diffusers pipeline and how their outputs form a TextBatch.

    Encoders are named by kind, read from a folder's ``config.json`` ``model_type``: ``t5`` (T5,
    UMT5, mT5), ``clip`` (``clip_text_model``), else the model type itself (``qwen2_5_vl``,
    ``gemma2``). Several CLIPs are taken in the order given (CLIP-L, then CLIP-G).

    Attributes:
        seq: kind of the encoder whose hidden states are ``TextBatch.seq`` ``(B, L, D)``.
        pooled: CLIP kinds whose pooled outputs, concatenated in order, are ``TextBatch.pooled``.
        clip_states: SD3: the CLIPs' penultimate states, concatenated by feature and zero-padded
            to the seq width, come before the seq tokens (all tokens visible, as the pipeline).
        max_length: tokens L of the seq encoder (the pipeline's ``max_sequence_length``).
        hidden_layer: which hidden state of the seq encoder (-1: the last; Lumina 2: -2).
        template, drop: prompt template and the template tokens dropped from the front of the
            states (Qwen-Image: its system prompt, 34 tokens).
    """

    seq: str
    pooled: tuple[str, ...] = ()
    clip_states: bool = False
    max_length: int = 256
    hidden_layer: int = -1
    template: str = "{}"
    drop: int = 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every encoder's kind, in the order expected (CLIPs first, then the seq encoder)."""
        return (*self.pooled, self.seq)


QWEN_IMAGE_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
                       "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
                       "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
"""``QwenImagePipeline.prompt_template_encode`` (diffusers 0.42.1); its first 34 tokens are dropped."""


def guided_inputs(family, model, latents: torch.Tensor, sigmas: torch.Tensor, text, guidance: float = 1.0) -> dict:
    """``family.make_inputs(model, latents, sigmas, text)`` with a guidance-distilled model's
    ``guidance`` input at ``guidance`` (SimpleTuner's ``flux_guidance_value``).

    Rule: ``make_inputs`` builds ``guidance`` at 1.0, scaled as the family's pipeline scales its
    guidance scale (Flux: as it is; HunyuanVideo: x 1000); this multiplies it by ``guidance``, so
    1.0 leaves the inputs as they are. Families without a guidance input (``guidance_input``
    False) are refused another value by the config (``engine/config/objective.py``).
    """
    inputs = family.make_inputs(model, latents, sigmas, text)
    if guidance != 1.0 and "guidance" in inputs:
        inputs["guidance"] = inputs["guidance"] * guidance
    return inputs
