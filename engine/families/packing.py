"""Latent packing helpers shared by families whose transformers take 2x2-packed token sequences."""

from __future__ import annotations

import torch


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """Pack ``(B, C, H, W)`` latents into ``(B, H/2 * W/2, 4C)`` tokens (Flux/QwenImage layout).

    Raises:
        ValueError: H or W is odd.
    """
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even for 2x2 packing, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_2x2`: ``(B, H/2 * W/2, 4C)`` tokens to ``(B, C, H, W)`` latents."""
    b, _, d = tokens.shape
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Flux-style positional ids of a packed ``height x width`` latent grid: ``(H/2 * W/2, 3)``."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def read_packed_2x2(model, output, latents: torch.Tensor) -> torch.Tensor:
    """``read_output`` of families whose model returns packed 2x2 tokens first (Flux and kin):
    ``output[0]`` ``(B, H/2 * W/2, 4C)`` back to latents ``(B, C, H, W)``."""
    return unpack_2x2(output[0], latents.shape[-2], latents.shape[-1])
