"""A video family's frame rule: how many pixel frames its VAE takes, and the tiny preset's video VAE.

A causal video VAE keeps the first frame and compresses every ``temporal`` frames after it into one
latent frame: ``temporal * k + 1`` pixel frames give ``k + 1`` latent frames (diffusers'
``pipeline_wan.py`` ``check_inputs``: Wan and HunyuanVideo "4k+1"; ``pipeline_ltx.py``: 8k+1). An
image is ``k = 0``. The most frames: the model's latent-frame limit (``engine/families/limits.py``).
Image families declare no :class:`FrameRule` (``FamilyAdapter.frames``) and take one frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class FrameRule:
    """The pixel-frame counts a video family's VAE takes: ``temporal * k + 1``.

    Attributes:
        temporal: pixel frames per latent frame after the first (the VAE's temporal compression
            ratio: 4 for Wan 2.1 and HunyuanVideo, 8 for LTX-Video).
        vae_class: the diffusers VAE class of the family (the tiny preset builds one).
        tiny_vae: the tiny preset's VAE config (random init; the real temporal and spatial
            compression, few channels).
        source: where the rule is stated.
    """

    temporal: int
    vae_class: str
    tiny_vae: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def formula(self) -> str:
        """``4k+1``."""
        return f"{self.temporal}k+1"

    def allows(self, frames: int) -> bool:
        """Whether ``frames`` pixel frames follow the rule (1 is always allowed: an image)."""
        return frames >= 1 and (frames - 1) % self.temporal == 0

    def latent_frames(self, frames: int) -> int:
        """Latent frames of ``frames`` allowed pixel frames: ``(frames - 1) // temporal + 1``."""
        return (frames - 1) // self.temporal + 1

    def pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames that give ``latent_frames``: ``temporal * (latent_frames - 1) + 1``."""
        return self.temporal * (latent_frames - 1) + 1

    def nearest(self, frames: int, most: int | None = None) -> tuple[int, ...]:
        """The allowed counts around ``frames`` (the one below and the one above, within ``most``)."""
        below = max(1, (frames - 1) // self.temporal * self.temporal + 1)
        found = [n for n in (below, below + self.temporal) if n != frames and (most is None or n <= most)]
        return tuple(found or [below])

    def describe(self, most: int | None = None) -> str:
        """``4k+1 (1, 5, 9, ..., at most 129)``."""
        first = ", ".join(str(self.pixel_frames(k)) for k in (1, 2, 3))
        bound = f", at most {most}" if most is not None else ""
        return f"{self.formula} ({first}, ...{bound})"


def vae_temporal(vae: Any) -> int:
    """Pixel frames per latent frame of a diffusers VAE, as its pipelines read it:
    ``temporal_compression_ratio`` (HunyuanVideo, LTX-Video), else ``2 ** sum(temperal_downsample)``
    (Wan: ``pipeline_wan.py`` ``vae_scale_factor_temporal``), else 1 (an image VAE)."""
    ratio = getattr(vae, "temporal_compression_ratio", None)
    if isinstance(ratio, int) and ratio >= 1:
        return ratio
    down = vae.config.get("temperal_downsample") if hasattr(vae, "config") else None
    return 2 ** sum(bool(d) for d in down) if down else 1


WAN_VAE = FrameRule(4, "AutoencoderKLWan", {
    "base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True]},
    source="pipeline_wan.py: num_frames - 1 divisible by vae_scale_factor_temporal (4)")
"""Wan 2.1's VAE (``AutoencoderKLWan``: 8x spatial, 4x temporal); Wan VACE, Cosmos Predict 2 and
SANA-Video use it too."""
HUNYUAN_VIDEO_VAE = FrameRule(4, "AutoencoderKLHunyuanVideo", {
    "latent_channels": 16, "block_out_channels": (8, 8, 16, 16), "layers_per_block": 1, "norm_num_groups": 8,
    "mid_block_add_attention": False},
    source="pipeline_hunyuan_video.py: (num_frames - 1) // vae_scale_factor_temporal + 1 latent frames (4)")
"""HunyuanVideo's VAE (``AutoencoderKLHunyuanVideo``: 8x spatial, 4x temporal); Kandinsky 5 uses it."""
LTX_VIDEO_VAE = FrameRule(8, "AutoencoderKLLTXVideo", {
    "latent_channels": 128, "block_out_channels": (8, 8, 16, 16), "decoder_block_out_channels": (8, 8, 16, 16),
    "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1, 1)},
    source="pipeline_ltx.py: (num_frames - 1) // vae_temporal_compression_ratio + 1 latent frames (8)")
"""LTX-Video 0.9's VAE (``AutoencoderKLLTXVideo``: 32x spatial, 8x temporal)."""
