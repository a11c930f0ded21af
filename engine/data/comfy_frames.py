"""Training data from a ComfyUI ``IMAGE`` batch with a caption: a clip's frames for a video family
(what core Load Video -> Get Video Components, or Video Helper Suite's loaders give), or images
for an image family.

``IMAGE`` is ``(B, H, W, 3)`` float in [0, 1] (ComfyUI 0.3.64 ``comfy_api/latest/_input_impl``
decodes video frames with PyAV to RGB and divides by 255). Each frame is turned back into 8-bit
RGB and trains at its own size, centre-cropped to the model's pixel multiple (as ComfyUI's own
Train LoRA takes the images it is given; resize with ComfyUI's image nodes first), through the
fitting a clip file's frames go through (``engine/data/video.py`` ``fit_frame``): a folder of the
same frames at a ``resolution`` equal to their side encodes equal pixels. The frames trained follow the data options
(``engine/data/windows.py``): a video family takes the largest of ``frame_counts`` the batch holds
(with no frame option set, the most frames of the batch the family's rule allows: 33 of 35 for
4k+1),
by ``frame_sampling`` (``first``, or ``uniform``; ``random`` takes the first window, said in the
summary); ``frame_rate`` does not apply (a batch states no rate).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from ..config import DataConfig
from ..families import FamilyAdapter, TextBatch
from .buckets import latent_multiple, vae_downscale
from .cache import encode_latents
from .comfy_data import ComfyDataError, PreparedData, comfy_latent_format
from .video import ClipInfo, fit_frame, frame_indices

SOURCE = "ComfyUI IMAGE batch + caption"


def batch_frames(images: Any) -> list[Image.Image]:
    """A ComfyUI ``IMAGE`` ``(B, H, W, 3)`` (or ``(H, W, 3)``) in [0, 1] as 8-bit RGB frames (an
    alpha channel is dropped).

    Raises:
        ComfyDataError: not a tensor of that layout, empty, or non-finite.
    """
    if not isinstance(images, torch.Tensor) or images.ndim not in (3, 4) or images.shape[-1] not in (3, 4):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ComfyDataError(f"images is {shape}: allowed a ComfyUI IMAGE (B, H, W, 3) in [0, 1] (Load Image, "
                             "Load Video -> Get Video Components)")
    batch = images[None] if images.ndim == 3 else images
    if batch.shape[0] == 0 or not torch.isfinite(batch).all():
        raise ComfyDataError("images is empty or holds NaN or infinite values")
    pixels = (batch[..., :3].detach().cpu().float().clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return [Image.fromarray(np.ascontiguousarray(frame)) for frame in pixels]


def prepare_image_batch(family: FamilyAdapter, images: Any, caption: str, data: DataConfig,
                        encode: Callable[[torch.Tensor], torch.Tensor],
                        encode_text: Callable[[list[str]], TextBatch], multiple: int = 16) -> PreparedData:
    """An ``IMAGE`` batch and its caption as a run's data (:class:`~.comfy_data.PreparedData`).

    Args:
        family: the model's family (a video family: the batch is one clip; else each image a sample).
        images: ComfyUI ``IMAGE`` ``(B, H, W, 3)`` in [0, 1].
        caption: the caption of every sample.
        data: the frame options.
        encode: pixels ``(N, 3, H, W)`` or ``(1, 3, F, H, W)`` in [-1, 1] -> the engine's
            normalised latents (:func:`~.cache.encode_latents` with the bundle's VAE, or the
            graph's VAE mapped through the family's ComfyUI latent format).
        encode_text: the model's text encoder.
        multiple: pixels each trained side is a multiple of (:func:`image_batch_multiple`).

    Raises:
        ComfyDataError: see :func:`batch_frames`; a video family's batch holds fewer frames than
            the smallest frame count (named, with the key).
    """
    frames = batch_frames(images)
    width, height = frames[0].size
    size = (width // multiple * multiple, height // multiple * multiple)
    if min(size) == 0:
        raise ComfyDataError(f"images are {width}x{height} px: allowed sides of at least {multiple} px (the model's "
                             "pixel multiple)")
    if family.frames is None:
        pixels = torch.stack([fit_frame(f, size) for f in frames])
        count, used = len(frames), 1
    else:
        counts = data.frame_counts
        if not data.video:  # no frame option given: the whole clip, as the family's rule allows
            counts = (max(n for n in range(1, len(frames) + 1) if family.frames.allows(n)),)
        fits = [c for c in sorted(counts) if c <= len(frames)]
        if not fits:
            key = "frame_buckets" if data.frame_buckets else "num_frames"
            raise ComfyDataError(f"images holds {len(frames)} frames, fewer than {key}={min(data.frame_counts)}: "
                                 f"connect a longer clip, or lower {key} (allowed {family.frames.describe()})")
        used = fits[-1]
        info = ClipInfo(len(frames), 0.0, *frames[0].size)
        sampling = "uniform" if data.frame_sampling == "uniform" else "first"
        indices = frame_indices(info, used, None, sampling)
        pixels = torch.stack([fit_frame(frames[i], size) for i in indices], dim=1)[None]
        count = 1
    with torch.inference_mode(False):  # ComfyUI runs nodes in inference mode: the run needs normal tensors
        latents = encode(pixels).float().clone()
        text = encode_text([caption] * count)
        cache = {"latents": latents.contiguous(), "text_seq": text.seq.float().clone(), "text_mask": text.mask.clone()}
        if text.pooled is not None:
            cache["text_pooled"] = text.pooled.float().clone()
    summary = {"source": SOURCE, "images": count, "images_per_epoch": count, "latent_shape": list(latents.shape[1:]),
               "latent_format": "encoded here", "conditioning": "the caption", "text_tokens": text.seq.shape[1],
               "text_width": text.seq.shape[2], "pooled_width": None if text.pooled is None else text.pooled.shape[1],
               "frames": {"given": len(frames), "trained": used,
                          "frame_sampling": "first" if data.frame_sampling == "random" else data.frame_sampling}}
    return PreparedData(family.name, cache, summary)


def batch_encoder(family: FamilyAdapter, vae: torch.nn.Module | None, comfy_vae: Any = None
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``encode`` of :func:`prepare_image_batch`: ComfyUI's VAE of the graph when given
    (``VAE.encode`` takes ``(B, H, W, 3)`` in [0, 1] and gives the raw latents, which the family's
    ComfyUI latent format normalises, ``engine/data/comfy_data.py``), else the bundle's diffusers VAE
    (:func:`~.cache.encode_latents`).

    Raises:
        ComfyDataError: neither VAE; ComfyUI's VAE for a family without a ComfyUI latent mapping.
    """
    if comfy_vae is not None:
        fmt = comfy_latent_format(family)

        def encode_comfy(pixels: torch.Tensor) -> torch.Tensor:
            frames = (pixels[0].permute(1, 2, 3, 0) if pixels.ndim == 5 else pixels.permute(0, 2, 3, 1))
            with torch.inference_mode():  # as ComfyUI's VAE Encode runs (its weights are inference tensors)
                raw = comfy_vae.encode((frames + 1) / 2)
            raw = raw.float().cpu().clone()  # a normal tensor (the caller left inference mode)
            if family.video_latents and raw.ndim == 4:
                raw = raw.unsqueeze(2)
            return fmt.process_in(raw)

        return encode_comfy
    if vae is None:
        raise ComfyDataError("images need a VAE to be encoded: connect the vae input (the model's VAE), or load a "
                             "model with its VAE")
    return lambda pixels: encode_latents(vae, pixels, family.video_latents)


def image_batch_multiple(family: FamilyAdapter, config: Any, vae: torch.nn.Module | None, comfy_vae: Any = None) -> int:
    """Pixels each side of an ``IMAGE`` batch is cropped to a multiple of: the VAE's spatial
    downscale (ComfyUI's ``VAE.downscale_ratio``, its last entry for a video VAE; else the
    bundle's VAE, ``engine/data/buckets.py`` ``vae_downscale``; else 8) x the latent multiple."""
    ratio = getattr(comfy_vae, "downscale_ratio", None)
    if isinstance(ratio, (tuple, list)):
        ratio = ratio[-1]
    if not isinstance(ratio, int):
        ratio = vae_downscale(vae) if vae is not None else 8
    return ratio * latent_multiple(family, config)
