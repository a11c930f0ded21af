"""Loading the model of a run: its device, its precision and the :class:`~.bundle.ModelBundle`
from a diffusers folder, one ``.safetensors`` file or a tiny preset (the first stage of a run;
the measurement entry points and the nodes call it too)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..config import ModelConfig
from .bundle import ModelBundle, build_preset
from .folders import load_model_folder, stored_dtype
from .precision import Precision, resolve_precision
from .single_file import load_model_file, stored_file_dtype


def resolve_device(model: ModelConfig) -> torch.device:
    """``cuda`` when asked or (``auto``) available, else ``cpu`` (the run's checks already refused
    ``cuda`` without CUDA)."""
    use_cuda = model.device == "cuda" or (model.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def run_precision(model: ModelConfig, device: torch.device) -> Precision:
    """The :class:`Precision` of ``model`` on ``device`` (reads weight headers for ``no_change``).

    Raises:
        PrecisionError: see :func:`~.precision.resolve_precision`.
    """
    stored = torch.float32
    if model.base_model_precision == "no_change" and model.model_path:
        stored = stored_dtype(model.model_path)
    elif model.base_model_precision == "no_change" and model.model_file:
        stored = stored_file_dtype(model.model_file)
    return resolve_precision(model.base_model_precision, model.mixed_precision, device, stored)


def load_bundle(model: ModelConfig, seed: int = 0, precision: Precision | None = None,
                log: Callable[[str], None] = print) -> ModelBundle:
    """The model ``model`` names: a local folder when ``model_path`` is set, one ``.safetensors``
    file when ``model_file`` is (both loaded straight into the run's storage dtype; a file's
    family, layout and variant go to ``log``), else the preset (random init in fp32 from
    ``seed``; training casts it).

    Raises:
        ModelLoadError: the folder or file cannot be used (named, with what was found).
    """
    precision = precision or run_precision(model, resolve_device(model))
    if model.model_path:
        bundle = load_model_folder(model.model_path, model.family, model.vae_path, model.text_encoder_path,
                                   seed=seed, dtype=precision.storage_dtype)
    elif model.model_file:
        bundle = load_model_file(model.model_file, model.family, model.vae_path, model.text_encoder_path, seed=seed,
                                 dtype=precision.storage_dtype, log=log)
    else:
        bundle = build_preset(model.family, model.preset, seed=seed, text_encoders=model.text_encoder_path)
    return dataclasses.replace(bundle, base_precision=model.base_model_precision)
