"""Latent packing helpers shared by families whose transformers take packed token sequences:
2x2-packed images (Flux and kin) and patchified video (LTX-Video, LTX-2)."""

from __future__ import annotations

from .lazy import torch


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


def pack_video(latents: torch.Tensor, p: int, pt: int) -> torch.Tensor:
    """``(B, C, F, H, W)`` latents to ``(B, F/pt * H/p * W/p, C * pt * p * p)`` tokens
    (``LTXPipeline._pack_latents``)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: torch.Tensor, shape: torch.Size, p: int, pt: int) -> torch.Tensor:
    """Inverse of :func:`pack_video` (``LTXPipeline._unpack_latents``) for latents of ``shape``."""
    b, _, f, h, w = shape
    x = tokens.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def read_packed_video(model, output, latents: torch.Tensor) -> torch.Tensor:
    """``read_output`` of families whose model returns :func:`pack_video` tokens first (LTX-Video,
    LTX-2), with the model's ``patch_size`` / ``patch_size_t``: back to latents ``(B, C, F, H, W)``."""
    return unpack_video(output[0], latents.shape, model.config.patch_size, model.config.patch_size_t)
