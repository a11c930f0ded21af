"""Frame counts as a measurement dimension: ``segckpt sweep --frames 1 5 9`` and ``plan --frames``.

A sweep, a probe or a pre-flight of a video family measures clips of ``n`` pixel frames on latents
of the shape the family's VAE gives them: ``(N, C, F', h, w)`` with ``F' = rule.latent_frames(n)``
(``engine/families/frames.py``) and the ``(h, w)`` of the run's data at its resolution. The latents
are synthetic (seeded standard normal, the scale of normalised latents: the memory and time of a
step depend on their shape, not their values), at the run's square ``resolution`` (one batch
shape, buckets or not), and the text states are those of the run's own data
(its captions through its text encoder), so no clip has to be decoded or encoded to measure. They
train as prepared data (:class:`~..data.comfy_data.PreparedData`) of the workspace's runs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..config import ConfigError, ModelConfig
from ..data.buckets import shape_classes, vae_downscale
from ..data.comfy_data import PreparedData
from ..data.limits import frame_limit, model_shape
from ..data.precheck import check_frame_count
from ..families import get_family
from ..families.limits import token_count
from .runs import RunWorkspace

SOURCE = "synthetic clip latents (measurement)"


def check_measure_frames(model: ModelConfig, counts: Sequence[int], key: str = "--frames") -> tuple[int, ...]:
    """The pixel-frame counts of a measurement, checked against ``model``'s family's frame rule and the
    model's latent-frame limit (when its config can be read without loading it), in the order
    given, duplicates dropped.

    Raises:
        ConfigError: an empty list, or the first count the family refuses
            (:func:`~..data.precheck.check_frame_count`): ``--frames=4 is invalid for wan: allowed
            4k+1 (1, 5, ...)``; ``--frames=5 is invalid for flux: allowed 1 (flux is an image family; ...)``.
    """
    if not counts:
        raise ConfigError(f"{key} is empty: allowed one or more pixel-frame counts")
    family = get_family(model.family)
    shape = model_shape(model)
    most = frame_limit(family, shape.config) if shape is not None else None
    for n in counts:
        check_frame_count(family, key, n, most)
    return tuple(dict.fromkeys(counts))


def clip_shape(resolution: int, bundle, frames: int) -> tuple[int, ...]:
    """One synthetic sample's latent shape without channels: ``(F', h, w)`` for a video family
    (``F' = rule.latent_frames(frames)``), ``(h, w)`` for an image family; ``h = w =
    resolution // VAE downscale`` (``resolution``: the run's square side, pixels; latent cells).

    Raises:
        ConfigError: the model has no VAE to read the downscale from.
    """
    if bundle.vae is None:
        raise ConfigError(f"--frames needs the model's VAE (its downscale gives the latent size): {bundle.source} "
                          "has none; give --vae-path")
    side = resolution // vae_downscale(bundle.vae)
    rule = bundle.family.frames
    return (rule.latent_frames(frames), side, side) if rule is not None else (side, side)


def clip_data(cache: dict[str, torch.Tensor], resolution: int, seed: int, bundle, frames: int) -> PreparedData:
    """Synthetic latents of ``frames`` pixel frames at the run's square resolution, with the text
    of ``cache`` (the run's encoded data).

    Args:
        cache: a latent cache (:meth:`~.runs.RunWorkspace.data_cache`): its latent channels C and
            every row's text states are kept.
        resolution: the run's square side, pixels. seed: the run's seed (the latents' generator).
        bundle: the model (VAE, family).
        frames: pixel frames, allowed by the family's rule (image families: 1).

    Returns:
        Prepared data: ``latents (N, C, F', h, w)`` (video families) or ``(N, C, h, w)`` (image
        families), seeded standard normal, N the cache's rows.
    """
    text = {k: v.contiguous() for k, v in cache.items() if k.startswith("text_")}
    count = text["text_seq"].shape[0]
    channels = shape_classes(cache)[0][0][0]
    dims = (channels, *clip_shape(resolution, bundle, frames))
    latents = torch.randn(count, *dims, generator=torch.Generator().manual_seed(seed))
    summary = {"source": SOURCE, "images": count, "images_per_epoch": count, "latent_shape": list(dims),
               "latent_format": "standard normal", "conditioning": "the run's captions",
               "text_tokens": text["text_seq"].shape[1], "text_width": text["text_seq"].shape[2],
               "pixel_frames": frames}
    return PreparedData(bundle.family.name, {"latents": latents, **text}, summary)


def frames_label(resolution: int, bundle, frames: int) -> str:
    """``5 frames (2 latent frames, 128 tokens per sample)``: what a measurement at ``frames``
    and the square ``resolution`` trains on (:func:`clip_shape`; tokens: :func:`~..families.limits.token_count`)."""
    shape = clip_shape(resolution, bundle, frames)
    tokens = token_count(bundle.family, dict(bundle.transformer.config), (0, *shape))
    latent = f"{shape[0]} latent frame{'s' if shape[0] != 1 else ''}, " if len(shape) == 3 else ""
    return f"{frames} frame{'s' if frames != 1 else ''} ({latent}{tokens} tokens per sample)"


@contextlib.contextmanager
def use_frames(workspace: RunWorkspace, frames: int) -> Iterator[PreparedData]:
    """Within it, ``workspace``'s runs train on :func:`clip_data` of ``frames`` pixel frames (the
    workspace's own data is encoded once, at the first use); its data and settings come back after.

    Yields:
        The prepared clip data the runs train on.
    """
    base = workspace._frames_base
    if base is None:
        base = workspace._frames_base = workspace.data_cache()
    config = workspace.config
    clips = clip_data(base, config.data.resolution, config.seed, workspace.bundle, frames)
    saved = workspace.config, workspace.data, workspace.prepared
    # prepared data is one batch shape and no folder; num_frames says what the runs train at
    workspace.config = workspace.config.replace(data=None, buckets=False, num_frames=frames, frame_buckets=None,
                                                min_frames=None)
    workspace.data, workspace.prepared = None, clips
    try:
        yield clips
    finally:
        workspace.config, workspace.data, workspace.prepared = saved
