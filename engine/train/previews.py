"""Validation previews: every N steps, one small image per validation prompt, sampled with the LoRA
being trained, saved beside the report and reported to the caller (the node shows them).

Sampling follows diffusers' flow-matching pipelines: :class:`diffusers.FlowMatchEulerDiscreteScheduler`
gives the sigmas from 1 to 0 and the Euler step ``x <- x + (sigma_next - sigma) * v``, where ``v`` is
the model's velocity (``noise - x0``, what the families train to predict); the transformer runs
through the family adapter, with gradients off (so no checkpoint region runs) under the run's
autocast. The latents are decoded by the run's decoder: the bundle's VAE (undoing the
normalisation of :func:`~..data.cache.encode_latents`), or one a caller gives (ComfyUI's VAE in
the node pack). Families trained on the epsilon objective get no preview (the run says so).

The preview phase is measured on its own (peak bytes), kept out of the step timing.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from ..core.memory import PeakMemory
from ..data.buckets import sample_latent_shape
from ..data.comfy_data import PreparedData, comfy_latent_format
from ..families import FamilyAdapter, TextBatch
from ..files.atomic import atomic_write_bytes
from ..model.attention_kernels import sdpa_context

PREVIEW_FOLDER = "previews"


@dataclass
class PreviewSource:
    """What previews are sampled from.

    Attributes:
        text: the prompts' text states (one row per prompt) for the family's transformer.
        decode: normalised latents ``(N, C, h, w)`` (or ``(N, C, 1, h, w)``) -> images
            ``(N, 3, H, W)`` in [0, 1].
        latent_shape: one sample's latent shape ``(C, h, w)`` (or ``(C, 1, h, w)``).
        names: a short name per prompt (file names).
    """

    text: TextBatch
    decode: Callable[[torch.Tensor], torch.Tensor]
    latent_shape: tuple[int, ...]
    names: list[str]


def vae_decoder(vae: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Decode the engine's normalised latents with a diffusers VAE (the inverse of
    :func:`~..data.cache.encode_latents`): ``(N, C, h, w)`` -> ``(N, 3, 8h, 8w)`` in [0, 1]."""

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> torch.Tensor:
        cfg = vae.config
        z = latents.float().to(device)
        if getattr(cfg, "latents_mean", None) is not None:
            shape = (1, -1) + (1,) * (z.ndim - 2)
            z = z * torch.tensor(cfg.latents_std, device=device).view(shape) + torch.tensor(
                cfg.latents_mean, device=device).view(shape)
        else:
            z = z / (getattr(cfg, "scaling_factor", None) or 1.0) + (getattr(cfg, "shift_factor", None) or 0.0)
        is_3d = hasattr(cfg, "z_dim") or "temperal_downsample" in cfg
        if is_3d and z.ndim == 4:
            z = z.unsqueeze(2)
        vae.to(device)
        try:
            images = vae.decode(z).sample
        finally:
            vae.to("cpu")
        if images.ndim == 5:
            images = images[:, :, 0]
        return ((images.float() + 1.0) / 2.0).clamp(0.0, 1.0).cpu()

    return decode


@torch.no_grad()
def sample(model: torch.nn.Module, family: FamilyAdapter, source: PreviewSource, steps: int, seed: int,
           device: torch.device, autocast: Callable[[], object]) -> torch.Tensor:
    """Images ``(P, 3, H, W)`` in [0, 1] for the source's ``P`` prompts: ``steps`` Euler steps of
    the flow-matching ODE from seeded noise (the same noise at every preview, so previews of one
    run compare), then the decoder."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(steps)
    count = source.text.seq.shape[0]
    noise = torch.randn((count, *source.latent_shape), generator=torch.Generator().manual_seed(seed))
    x, text = noise.to(device), source.text.to(device)
    was_training = model.training
    model.eval()
    try:
        for i, t in enumerate(scheduler.timesteps):
            sigma = scheduler.sigmas[i].to(device).expand(count).contiguous()
            with autocast():
                output = model(**family.make_inputs(model, x, sigma, text))
                velocity = family.read_output(model, output, x).float()
            x = scheduler.step(velocity, t, x).prev_sample
    finally:
        model.train(was_training)
    return source.decode(x.float().cpu())


def write_previews(images: torch.Tensor, names: list[str], folder: Path, step: int) -> list[Path]:
    """Save ``(P, 3, H, W)`` images in [0, 1] as ``step_00004_<name>.png`` (atomic); their paths."""
    paths = []
    for image, name in zip(images, names):
        pixels = (image.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        paths.append(atomic_write_bytes(folder / f"step_{step:05d}_{name}.png", png.getvalue()))
    return paths


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
        images = sample(ctx.model, ctx.family, source, steps, seed, ctx.device, kernels_and_autocast)
    return (write_previews(images, source.names, folder, step) if write else []), reading.peak_bytes


def preview_source_for(config, bundle, latent_shape: tuple[int, ...], device: torch.device,
                       given: PreviewSource | None, first_caption: str,
                       log: Callable[[str], None]) -> PreviewSource | None:
    """What a run's previews sample from: ``given`` (ComfyUI's conditioning and VAE), else the
    validation prompts (default: the data's first caption) through the bundle's text encoder,
    decoded by its VAE; None when previews cannot run (an epsilon-objective family, no VAE), said
    in ``log``.

    Args:
        config: the run's TrainConfig. bundle: its ModelBundle. latent_shape: one sample's latent
            shape ``(C, h, w)`` (:func:`~..data.buckets.sample_latent_shape`).
    """
    family = bundle.family
    if family.objective != "flow":
        log(f"previews: off ({family.name} trains on the {family.objective} objective; previews sample "
            "flow-matching families)")
        return None
    if given is None and bundle.vae is not None:
        prompts = list(config.validation.validation_prompts or [first_caption or "a photo"])
        given = PreviewSource(bundle.encode_text(prompts), vae_decoder(bundle.vae, device), latent_shape,
                              [f"prompt{i}" for i in range(len(prompts))])
    if given is None:
        log("previews: off (no VAE to decode them: give vae_path, or in ComfyUI connect a VAE)")
    return given


def comfy_preview_source(family: FamilyAdapter, prepared: PreparedData, vae) -> PreviewSource:
    """Previews of a run on ComfyUI latents: the first conditioning's text, decoded by ComfyUI's
    VAE (``VAE.decode`` takes the family's raw latents and gives ``(B, H, W, 3)`` in [0, 1], or
    ``(B, T, H, W, 3)`` for a video VAE (Wan's), of which the first frame is shown; the family's
    ComfyUI latent format undoes the normalisation first)."""
    fmt = comfy_latent_format(family)
    cache = prepared.cache
    text = TextBatch(cache["text_seq"][:1], cache["text_mask"][:1],
                     cache["text_pooled"][:1] if "text_pooled" in cache else None)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        images = vae.decode(fmt.process_out(latents))
        if images.ndim == 5:  # (B, T, H, W, 3): a video VAE's frames
            images = images[:, 0]
        return images.movedim(-1, 1).float().clamp(0, 1).cpu()

    return PreviewSource(text, decode, sample_latent_shape(cache), ["conditioning0"])
