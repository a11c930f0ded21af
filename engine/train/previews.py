"""Validation previews: every N steps, one small image per validation prompt, sampled with the LoRA
being trained, saved beside the report and reported to the caller (the node shows them). An image
family's previews are PNGs; a video family's are short clips, animated WebPs (Pillow; an ``<img>``
and ComfyUI's ``/view`` route show them as they are) of ``validation_frames`` pixel frames, a count
the family's frame rule allows (``engine/families/frames.py`` ``FrameRule``: ``temporal * k + 1``;
others are refused by ``engine/data/limits.py`` ``check_frames``); unset, the smallest allowed count
above one frame, ``rule.pixel_frames(2)`` (Wan, HunyuanVideo: 5; LTX-Video: 9). Their latents have
``rule.latent_frames(validation_frames)`` frames, whatever frame counts the data trained on.

Sampling follows diffusers' flow-matching pipelines: :class:`diffusers.FlowMatchEulerDiscreteScheduler`
with the model's own scheduler config (:func:`preview_scheduler`: its shift, or its dynamic shift at
the preview's image tokens, and its terminal stretch; ``engine/families/shift.py``) gives the sigmas
from the pipelines' ``linspace(1, 1/N, N)`` to 0 and the Euler step ``x <- x + (sigma_next - sigma) *
v``, where ``v`` is the model's velocity (``noise - x0``, what the families train to predict); the
transformer runs through the family adapter (a guidance-distilled model at the run's
``guidance_value``), with gradients off (so no checkpoint region runs) under the run's autocast. The latents are decoded by the run's decoder: the bundle's VAE (undoing the
normalisation of :func:`~..data.cache.encode_latents`), or one a caller gives (ComfyUI's VAE in
the node pack). Families trained on the epsilon objective get no preview (the run says so).

The preview phase is measured on its own (peak bytes), kept out of the step timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from ..config import ValidationConfig
from ..config.data import exact_rate
from ..core.memory import PeakMemory
from ..data.buckets import sample_latent_shape
from ..data.comfy_data import PreparedData, comfy_latent_format
from ..families import FamilyAdapter, TextBatch
from ..families.conditioning import guided_inputs
from ..families.limits import token_count
from ..families.shift import FlowShift
from ..files.atomic import atomic_write_bytes
from ..model.attention_kernels import sdpa_context

PREVIEW_FOLDER = "previews"
DEFAULT_FPS = 16.0
"""Frames per second of a preview clip when the run sets no ``frame_rate`` (Wan 2.1's pipelines
write their clips at 16 fps)."""
WEBP_QUALITY = 90
"""Lossy WebP quality (0-100) of a preview clip's frames."""


def preview_frames(family, validation_frames: int | None) -> int:
    """Pixel frames of one preview of ``family``: 1 for an image family (``validation_frames`` is
    ignored), else ``validation_frames`` or, unset, the family's smallest count above 1."""
    rule = family.frames
    if rule is None:
        return 1
    return validation_frames if validation_frames is not None else rule.pixel_frames(2)


def preview_latent_shape(family, latent_shape: tuple[int, ...], validation_frames: int | None) -> tuple[int, ...]:
    """One preview's latent shape: a video family's ``(C, F', h, w)`` with ``F' =
    rule.latent_frames(preview_frames(...))`` (the cache's ``F'`` may be 1, an image, or another
    count); an image family's ``latent_shape`` as it is (``(C, h, w)``)."""
    if family.frames is None or len(latent_shape) != 4:
        return tuple(latent_shape)
    channels, _, height, width = latent_shape
    return (channels, family.frames.latent_frames(preview_frames(family, validation_frames)), height, width)


def _pixels(image: torch.Tensor) -> np.ndarray:
    """``(3, H, W)`` in [0, 1] -> ``(H, W, 3)`` uint8."""
    return (image.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8)


def encode_png(image: torch.Tensor) -> bytes:
    """A PNG of an image ``(3, H, W)`` in [0, 1]."""
    out = io.BytesIO()
    Image.fromarray(_pixels(image)).save(out, format="PNG")
    return out.getvalue()


def encode_webp(clip: torch.Tensor, fps: float | Fraction = DEFAULT_FPS) -> bytes:
    """An animated WebP of a clip ``(3, F, H, W)`` in [0, 1]: frame ``k`` starts at ``k / fps`` s
    (exact, ``engine/config/data.py`` ``exact_rate``: 23.976 is 24000/1001) rounded to the nearest
    whole ms (WebP's unit), so the durations alternate (41, 42 ms) rather than drift; looping
    (``loop=0``), quality :data:`WEBP_QUALITY`."""
    frames = [Image.fromarray(_pixels(frame)) for frame in clip.unbind(1)]
    period = 1000 / exact_rate(fps)
    starts = [math.floor(k * period + Fraction(1, 2)) for k in range(len(frames) + 1)]
    out = io.BytesIO()
    frames[0].save(out, format="WEBP", save_all=True, append_images=frames[1:],
                   duration=[end - start for start, end in zip(starts, starts[1:])], loop=0, quality=WEBP_QUALITY)
    return out.getvalue()


def write_previews(images: torch.Tensor, names: list[str], folder: Path, step: int,
                   fps: float = DEFAULT_FPS) -> list[Path]:
    """Save one preview per name (atomic) and return their paths: images ``(P, 3, H, W)`` in [0, 1]
    as ``step_00004_<name>.png``; clips ``(P, 3, F, H, W)`` as ``step_00004_<name>.webp``
    (animated, ``fps`` frames per second)."""
    clip = images.ndim == 5
    return [atomic_write_bytes(folder / f"step_{step:05d}_{name}.{'webp' if clip else 'png'}",
                               encode_webp(image, fps) if clip else encode_png(image))
            for image, name in zip(images, names)]


@dataclass
class PreviewSource:
    """What previews are sampled from.

    Attributes:
        text: the prompts' text states (one row per prompt) for the family's transformer.
        decode: normalised latents ``(N, C, h, w)`` (or ``(N, C, 1, h, w)``) -> images
            ``(N, 3, H, W)`` in [0, 1]; a clip's ``(N, C, F', h, w)`` (``F' > 1``) -> frames
            ``(N, 3, F, H, W)``.
        latent_shape: one preview's latent shape ``(C, h, w)``, ``(C, 1, h, w)``, or a clip's
            ``(C, F', h, w)`` (:func:`preview_latent_shape`).
        names: a short name per prompt (file names).
        fps: frames per second of a clip preview's file.
    """

    text: TextBatch
    decode: Callable[[torch.Tensor], torch.Tensor]
    latent_shape: tuple[int, ...]
    names: list[str]
    fps: float = DEFAULT_FPS


def vae_decoder(vae: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Decode the engine's normalised latents with a diffusers VAE (the inverse of
    :func:`~..data.cache.encode_latents`, each of its three normalisations): ``(N, C, h, w)`` or
    ``(N, C, 1, h, w)`` -> images ``(N, 3, H, W)`` in [0, 1]; a video VAE's clip latents
    ``(N, C, F', h, w)`` with ``F' > 1`` -> frames ``(N, 3, F, H, W)``, ``F = temporal * (F' - 1) + 1``
    (the VAE's causal decoding; ``engine/families/frames.py``)."""

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> torch.Tensor:
        cfg = vae.config
        z = latents.float().to(device)
        shape = (1, -1) + (1,) * (z.ndim - 2)
        scale = getattr(cfg, "scaling_factor", None) or 1.0
        buffers = dict(vae.named_buffers(recurse=False))
        if getattr(cfg, "latents_mean", None) is not None:  # Wan: (z - mean) / std
            z = z * torch.tensor(cfg.latents_std, device=device).view(shape) + torch.tensor(
                cfg.latents_mean, device=device).view(shape)
        elif "latents_mean" in buffers:  # LTX-Video's buffers: (z - mean) * scale / std
            z = z * buffers["latents_std"].view(shape).to(z) / scale + buffers["latents_mean"].view(shape).to(z)
        else:
            z = z / scale + (getattr(cfg, "shift_factor", None) or 0.0)
        is_3d = hasattr(cfg, "z_dim") or "temperal_downsample" in cfg or "temporal_compression_ratio" in cfg
        if is_3d and z.ndim == 4:
            z = z.unsqueeze(2)
        vae.to(device)
        try:
            images = vae.decode(z).sample
        finally:
            vae.to("cpu")
        if images.ndim == 5 and z.shape[2] == 1:  # one latent frame: an image
            images = images[:, :, 0]
        return ((images.float() + 1.0) / 2.0).clamp(0.0, 1.0).cpu()

    return decode


def preview_scheduler(shift: FlowShift | None, steps: int, tokens: Callable[[], int]) -> FlowMatchEulerDiscreteScheduler:
    """The Euler scheduler of a ``steps``-step inference with the model's scheduler config ``shift``
    (``None``: unshifted): its static shift, or with dynamic shifting the mu its pipeline computes
    for ``tokens()`` image tokens (Flux.2's at ``steps`` steps), its time-shift type and terminal
    stretch (none for one step, which has no last step to stretch), set to the sigmas the
    pipelines pass, ``linspace(1, 1/steps, steps)``."""
    shift = shift or FlowShift()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=shift.shift, use_dynamic_shifting=shift.use_dynamic_shifting, base_shift=shift.base_shift,
        max_shift=shift.max_shift, base_image_seq_len=shift.base_image_seq_len,
        max_image_seq_len=shift.max_image_seq_len, time_shift_type=shift.time_shift_type,
        shift_terminal=shift.shift_terminal if steps > 1 else None)
    mu = None
    if shift.use_dynamic_shifting:
        at_steps = dataclasses.replace(shift, mu_steps=steps) if shift.mu_steps is not None else shift
        mu = at_steps.resolve(tokens()).mu
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler


@dataclass(frozen=True)
class Sampling:
    """How one preview round samples: ``steps`` Euler steps, the noise's ``seed``, the model's
    scheduler config ``shift`` (None: unshifted) and the ``guidance`` of a guidance-distilled model."""

    steps: int
    seed: int
    shift: FlowShift | None = None
    guidance: float = 1.0


@torch.no_grad()
def sample(model: torch.nn.Module, family: FamilyAdapter, source: PreviewSource, sampling: Sampling,
           device: torch.device, autocast: Callable[[], object]) -> torch.Tensor:
    """Images ``(P, 3, H, W)`` (clips: ``(P, 3, F, H, W)``) in [0, 1] for the source's ``P`` prompts:
    ``sampling.steps`` Euler steps of the flow-matching ODE (:func:`preview_scheduler` with the
    model's scheduler config ``sampling.shift``) from seeded noise (the same noise at every preview,
    so previews of one run compare), at ``sampling.guidance``, then the decoder."""
    steps, guidance = sampling.steps, sampling.guidance
    scheduler = preview_scheduler(sampling.shift, steps, lambda: token_count(family, model.config, source.latent_shape))
    count = source.text.seq.shape[0]
    noise = torch.randn((count, *source.latent_shape), generator=torch.Generator().manual_seed(sampling.seed))
    x, text = noise.to(device), source.text.to(device)
    was_training = model.training
    model.eval()
    try:
        for i, t in enumerate(scheduler.timesteps):
            sigma = scheduler.sigmas[i].to(device).expand(count).contiguous()
            with autocast():
                output = model(**guided_inputs(family, model, x, sigma, text, guidance))
                velocity = family.read_output(model, output, x).float()
            x = scheduler.step(velocity, t, x).prev_sample
    finally:
        model.train(was_training)
    return source.decode(x.float().cpu())


def previews_at(step: int, every: int, last: int) -> bool:
    """Whether step ``step`` (1-based) samples previews: every ``every`` steps and at the last
    step (0 = never)."""
    return every > 0 and (step % every == 0 or step == last)


def run_previews(ctx, source: PreviewSource, steps: int, seed: int, folder: Path, step: int,
                 write: bool = True) -> tuple[list[Path], int]:
    """Sample, save and measure one preview round of the run whose :class:`~.step.StepContext`
    is ``ctx`` (its model, family and device, under its SDPA kernels and autocast): ``(paths,
    peak bytes of the phase)``.

    ``write=False`` (ranks other than 0 of a sharded run): sample alongside rank 0, whose forward
    passes need every rank's shards, and save nothing (no paths).
    """
    @contextlib.contextmanager
    def kernels_and_autocast():
        with sdpa_context(ctx.kernels), ctx.precision.autocast(ctx.device):
            yield

    meter = PeakMemory(ctx.device)
    with meter.measure() as reading:
        images = sample(ctx.model, ctx.family, source,
                        Sampling(steps, seed, ctx.noise.scheduler, ctx.config.objective.guidance_value), ctx.device,
                        kernels_and_autocast)
    return (write_previews(images, source.names, folder, step, source.fps) if write else []), reading.peak_bytes


def preview_source_for(validation: ValidationConfig, frame_rate: float | None, bundle, latent_shape: tuple[int, ...],
                       device: torch.device, given: PreviewSource | None, first_caption: str,
                       log: Callable[[str], None]) -> PreviewSource | None:
    """What a run's previews sample from: ``given`` (ComfyUI's conditioning and VAE), else the
    validation prompts (default: the data's first caption) through the bundle's text encoder,
    decoded by its VAE; None when previews cannot run (an epsilon-objective family, no VAE), said
    in ``log``. A video family's previews are clips of ``validation_frames`` frames
    (:func:`preview_latent_shape`), ``frame_rate`` (else 16) frames per second.

    Args:
        validation: the run's validation options. frame_rate: ``frame_rate`` (None: 16 frames per second).
        bundle: its ModelBundle. latent_shape: one sample's latent
            shape ``(C, h, w)`` or ``(C, F', h, w)`` (:func:`~..data.buckets.sample_latent_shape`).
    """
    family = bundle.family
    if family.objective != "flow":
        log(f"previews: off ({family.name} trains on the {family.objective} objective; previews sample "
            "flow-matching families)")
        return None
    if given is None and bundle.vae is not None:
        prompts = list(validation.validation_prompts or [first_caption or "a photo"])
        given = PreviewSource(bundle.encode_text(prompts), vae_decoder(bundle.vae, device),
                              preview_latent_shape(family, latent_shape, validation.validation_frames),
                              [f"prompt{i}" for i in range(len(prompts))], frame_rate or DEFAULT_FPS)
    if given is None:
        log("previews: off (no VAE to decode them: give vae_path, or in ComfyUI connect a VAE)")
    return given


def comfy_preview_source(family: FamilyAdapter, prepared: PreparedData, vae, validation_frames: int | None = None,
                         fps: float | None = None) -> PreviewSource:
    """Previews of a run on ComfyUI latents: the first conditioning's text, decoded by ComfyUI's
    VAE (``VAE.decode`` takes the family's raw latents and gives ``(B, H, W, 3)`` in [0, 1], or
    ``(B, T, H, W, 3)`` for a video VAE (Wan's): a clip ``(B, 3, T, H, W)`` when the latents have
    more than one frame, else the first frame; the family's ComfyUI latent format undoes the
    normalisation first). A video family samples clips of ``validation_frames`` frames
    (:func:`preview_latent_shape`), ``fps`` (unset: 16) frames per second."""
    fmt = comfy_latent_format(family)
    cache = prepared.cache
    text = TextBatch(cache["text_seq"][:1], cache["text_mask"][:1],
                     cache["text_pooled"][:1] if "text_pooled" in cache else None)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        images = vae.decode(fmt.process_out(latents))
        if images.ndim == 5 and (latents.ndim < 5 or latents.shape[2] == 1):  # (B, T, H, W, 3): one frame shown
            images = images[:, 0]
        return images.movedim(-1, 1).float().clamp(0, 1).cpu()  # (B, 3, H, W) or a clip's (B, 3, T, H, W)

    shape = preview_latent_shape(family, sample_latent_shape(cache), validation_frames)
    return PreviewSource(text, decode, shape, ["conditioning0"], fps or DEFAULT_FPS)
