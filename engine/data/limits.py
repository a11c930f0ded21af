"""The model's size limits applied to the run's data before any model is built: the square
``resolution`` is refused past the family's position tables (``engine/families/limits.py``), in
one line naming the option and the largest allowed value.

The run learns the model config and the VAE's downscale without reading a weight: the tiny
preset's ``tiny_config`` and its tiny ``AutoencoderKL``; a diffusers folder's ``config.json`` files
(the transformer's, with the class's defaults for the keys it leaves out, and the VAE's, built on
the ``meta`` device to read its downscale); a single file's header (the variant it identifies).
Where they cannot be read (a folder the loader will refuse, a single file without ``vae_path``)
nothing is checked here: the loader names the problem, and bucketing still leaves out what
exceeds the limits (``engine/data/prepare.py``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import diffusers
import torch

from ..config import ConfigError, DataConfig, ModelConfig
from ..families import FamilyAdapter, get_family
from ..families.limits import Limits, describe_bound, full_config, largest_square, model_limits, token_patch
from ..model.bundle import ModelBundle, ModelLoadError, tiny_vae
from ..model.folders import transformer_folder, vae_folder
from ..model.single_file import identify_file
from .buckets import vae_downscale
from .precheck import check_frame_counts


@dataclass(frozen=True)
class ModelShape:
    """What the run knows of its model before loading it.

    Attributes:
        family: the family adapter.
        config: the transformer config (every ``__init__`` key, defaults filled in).
        downscale: pixels per latent cell of the VAE, or ``None`` when no VAE is known yet.
        source: ``tiny preset``, ``model_path <folder>``, ``model_file <file>`` or the bundle's source.
    """

    family: FamilyAdapter
    config: Mapping[str, Any]
    downscale: int | None
    source: str

    @property
    def limits(self) -> Limits:
        """:func:`~..families.limits.model_limits` of this config."""
        return model_limits(self.family, self.config)

    @property
    def patch(self) -> int:
        """Latent cells per token side (:func:`~.buckets.token_patch`)."""
        return token_patch(self.family, self.config)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _meta_downscale(folder: Path) -> int:
    """:func:`~.buckets.vae_downscale` of the VAE whose ``config.json`` is in ``folder``, built on
    the ``meta`` device (no weight is read or allocated)."""
    values = _read_json(folder / "config.json")
    cls = getattr(diffusers, values.get("_class_name", ""))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vae_downscale(cls.from_config(values))


def model_shape(model: ModelConfig, bundle: ModelBundle | None = None) -> ModelShape | None:
    """The model config and VAE downscale of the ``model`` options' model, before loading it (``bundle``: a
    model the caller already loaded, read from it instead).

    Returns:
        The :class:`ModelShape`, or ``None`` when the configs cannot be read without loading (the
        loader then names what is wrong).
    """
    if bundle is not None:
        scale = vae_downscale(bundle.vae) if bundle.vae is not None else None
        return ModelShape(bundle.family, dict(bundle.transformer.config), scale, bundle.source)
    family = get_family(model.family)
    if not model.model_path and not model.model_file:
        with torch.device("meta"):
            scale = vae_downscale(tiny_vae(family))
        return ModelShape(family, full_config(family.model_cls(), family.tiny_config), scale,
                          f"{model.preset} preset")
    try:
        if model.model_path:
            values = _read_json(transformer_folder(model.model_path) / "config.json")
            if values.get("_class_name") != family.model_class:
                return None  # the loader refuses the folder, naming both classes
            vae = vae_folder(model.model_path, model.vae_path)
            source = f"model_path {model.model_path}"
        else:
            values, vae = identify_file(model.model_file, family.name).config, model.vae_path
            vae = Path(vae) if vae else None
            source = f"model_file {model.model_file}"
        scale = _meta_downscale(vae) if vae is not None else None
    except (OSError, ValueError, AttributeError, TypeError, KeyError, ModelLoadError):
        return None  # unreadable or unknown: the loader's own checks report it
    return ModelShape(family, full_config(family.model_cls(), values), scale, source)


def check_resolution(model: ModelConfig, data: DataConfig, validation_frames: int | None,
                     bundle: ModelBundle | None = None) -> Limits | None:
    """Refuse frame counts ``model``'s family does not take (:func:`check_frames`) and a square
    ``data.resolution`` whose token grid exceeds the model's limits, before any model is built (with buckets too: every bucket keeps the square's area, so when the square's
    grid does not fit, no bucket's does).

    Returns:
        The limits checked, or ``None`` when the model config cannot be read yet.

    Raises:
        ConfigError: ``resolution=1024 is invalid for sd3 (tiny preset): allowed at most 256
            (16x16 tokens (pos_embed_max_size 16) x patch 2 x VAE 8; the square is 64x64 tokens)``.
    """
    check_frames(model, data, validation_frames, bundle)
    shape = model_shape(model, bundle)
    if shape is None or shape.downscale is None:
        return None
    limits, res = shape.limits, data.resolution
    cells = res // shape.downscale // shape.patch
    if limits.fits(cells, cells):
        return limits
    best = largest_square(limits, shape.patch, shape.downscale, res)
    allowed = f"at most {best}" if best else "no square resolution"
    raise ConfigError(f"resolution={res} is invalid for {shape.family.name} ({shape.source}): allowed {allowed} "
                      f"({describe_bound(limits, shape.patch, shape.downscale)}; the square is "
                      f"{cells}x{cells} tokens)")


def frame_limit(family: FamilyAdapter, config: Mapping[str, Any]) -> int | None:
    """The most pixel frames the model takes: its latent-frame limit (``engine/families/limits.py``)
    through the family's frame rule, or None (no bound, or an image family)."""
    rule, frames = family.frames, model_limits(family, config).frames
    return rule.pixel_frames(frames) if rule is not None and frames is not None else None


def check_frames(model: ModelConfig, data: DataConfig, validation_frames: int | None,
                 bundle: ModelBundle | None = None) -> None:
    """Refuse frame counts (``num_frames``, ``frame_buckets``, ``validation_frames``) the family
    does not take, before any model is built (``engine/data/precheck.py`` ``check_frame_counts``, which
    ``precheck`` runs before any heavy import without the bound; the bound is the model's
    latent-frame limit when its config can be read).

    Raises:
        ConfigError: the first count refused, naming its key, its value and the nearest allowed.
    """
    family = get_family(model.family)
    shape = model_shape(model, bundle)
    check_frame_counts(data, validation_frames, family, frame_limit(family, shape.config) if shape is not None else None)
