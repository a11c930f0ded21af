"""A loaded model (:class:`ModelBundle`: the family, the transformer, the VAE and the text
encoder) and the tiny random-init presets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import diffusers
import torch

from ..config.model import PRESETS
from ..families import FamilyAdapter, TextBatch, get_family
from ..families.shift import FlowShift
from .text_encoders import DeterministicTextEmbedder, load_text_encoders


class ModelLoadError(ValueError):
    """A model folder cannot be used; the message names the folder and what is wrong."""


@dataclass
class ModelBundle:
    """What training needs of a model.

    Attributes:
        family: the family adapter.
        transformer: the diffusers denoiser (``FluxTransformer2DModel``, ...), fp32, eval mode.
        vae: the diffusers autoencoder used to encode images to latents (``None``: a single-file
            model loaded without ``vae_path``; image data then cannot be encoded).
        encode_text: captions -> :class:`TextBatch` (a local text encoder, or the deterministic
            embedder of the built-in default).
        source: where it came from (``preset:tiny`` or the folder path), for the report.
        base_precision: the ``base_model_precision`` it was loaded for (``None``: not chosen
            yet; training applies the run's own).
        scheduler: a flow model's scheduler config as its pipeline folder's
            ``scheduler/scheduler_config.json`` gives it (``engine/families/shift.py``); ``None``:
            the folder has none (a file, a preset): the family's declared one applies (:attr:`inference_shift`).
    """

    family: FamilyAdapter
    transformer: torch.nn.Module
    vae: torch.nn.Module | None
    encode_text: Callable[[list[str]], TextBatch]
    source: str
    base_precision: str | None = None
    scheduler: FlowShift | None = None

    @property
    def inference_shift(self) -> FlowShift | None:
        """What the model infers with: :attr:`scheduler`, else the family's released config."""
        return self.scheduler if self.scheduler is not None else self.family.flow_shift


def tiny_vae_config(latent_channels: int) -> dict[str, Any]:
    """Config of a tiny random-init ``AutoencoderKL`` with the real 8x spatial downsampling."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "block_out_channels": (8, 8, 16, 16),
        "layers_per_block": 1,
        "latent_channels": latent_channels,
        "norm_num_groups": 8,
        "sample_size": 256,
    }


def tiny_vae(family: FamilyAdapter) -> torch.nn.Module:
    """The tiny preset's random-init VAE of ``family``: its video VAE class with the real temporal
    and spatial compression (``FrameRule.tiny_vae``, ``engine/families/frames.py``) for a video
    family that declares one, else the tiny ``AutoencoderKL`` (:func:`tiny_vae_config`; a video
    family then trains on single frames)."""
    rule = family.frames
    if rule is not None and rule.tiny_vae:
        return getattr(diffusers, rule.vae_class)(**rule.tiny_vae)
    return diffusers.AutoencoderKL(**tiny_vae_config(family.latent_channels))


def build_preset(family_name: str, preset: str = "tiny", seed: int = 0,
                 overrides: dict[str, Any] | None = None,
                 text_encoders: Sequence[str | Path] | None = None) -> ModelBundle:
    """A random-init model of ``family_name`` from its tiny preset (deterministic for a seed).

    Args:
        family_name: a registered family.
        preset: only ``tiny`` is defined.
        seed: seed of the random init.
        overrides: config keys replacing the preset's (e.g. ``{"num_layers": 4}``).
        text_encoders: local text encoder folders (:func:`~.text_encoders.load_text_encoders`; their
            widths must be the preset's); default: the deterministic stand-in embedder.

    Raises:
        KeyError: unknown family. ModelLoadError: unknown preset.
        TextEncoderError: the text encoder folders do not serve the family.
    """
    family = get_family(family_name)
    if preset not in PRESETS:
        raise ModelLoadError(f"preset={preset!r} is invalid: allowed {', '.join(PRESETS)}")
    torch.manual_seed(seed)
    transformer = family.model_cls()(**{**family.tiny_config, **(overrides or {})})
    vae = tiny_vae(family)
    spec = family.text(transformer.config)
    embedder = (load_text_encoders(text_encoders, family, spec) if text_encoders
                else DeterministicTextEmbedder(spec, seed=seed))
    return ModelBundle(family, transformer.eval(), vae.eval(), embedder, f"preset:{preset}")
