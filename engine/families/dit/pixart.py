"""PixArt-Alpha / PixArt-Sigma (``PixArtTransformer2DModel``): one list of DiT blocks.

PixArt is a DDPM epsilon model (1000 discrete timesteps): the timestep passed is the integer DDPM
step of sigma (:func:`..timesteps.ddpm_timesteps`), and the trainer must noise the latents with the
DDPM schedule of that timestep. Released checkpoints learn the variance (``out_channels = 2C``):
only the first ``C`` output channels are the epsilon prediction.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family
from ..timesteps import ddpm_timesteps

_VAE_SCALE = 8  # SD VAE: pixels per latent


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    added = {"resolution": None, "aspect_ratio": None}
    if model.use_additional_conditions:  # PixArt-Alpha 1024px: size micro-conditions, in pixels
        added = {
            "resolution": torch.tensor([[h * _VAE_SCALE, w * _VAE_SCALE]], device=latents.device,
                                       dtype=latents.dtype).expand(b, 2),
            "aspect_ratio": torch.full((b, 1), h / w, device=latents.device, dtype=latents.dtype),
        }
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "timestep": ddpm_timesteps(sigmas),  # objectives: sigma = t / 1000
        "added_cond_kwargs": added,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return output[0][:, : latents.shape[1]]  # drop the learned-variance half, if any


# Blocks (BasicTransformerBlock): block(hidden, attention_mask, encoder, encoder_attention_mask,
# timestep, cross_attention_kwargs, class_labels) -> hidden.
PIXART = register_family(
    FamilyAdapter(
        name="pixart",
        model_class="PixArtTransformer2DModel",
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention="attn1"),),
        text=lambda cfg: TextSpec(cfg["caption_channels"] or cfg["cross_attention_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "sample_size": 8,  # not 128: no resolution/aspect-ratio micro-conditions
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 8,  # learned sigma, as the released checkpoints
            "num_layers": 8,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "cross_attention_dim": 16,
            "caption_channels": 32,
        },
        latent_channels=4,
        objective="epsilon",
        notes=(
            "epsilon objective (DDPM, 1000 steps): timestep = round(sigma * 1000), clamped to 999",
            "learned-variance output channels are dropped: the loss sees the epsilon half only",
        ),
    )
)
