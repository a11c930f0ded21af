"""The model, device and precision of a run: what :class:`~.loop.TrainingRun` and the measurement
entry points (sweep, planner, nodes) resolve before they train."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .config import TrainConfig
from .loading import ModelBundle, build_preset, load_model_folder, stored_dtype
from .precision import Precision, resolve_precision
from .single_file import load_model_file, stored_file_dtype


def resolve_device(config: TrainConfig) -> torch.device:
    """``cuda`` when asked or (``auto``) available, else ``cpu`` (``TrainConfig.check_paths``
    already refused ``cuda`` without CUDA)."""
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def run_precision(config: TrainConfig, device: torch.device) -> Precision:
    """The :class:`Precision` of ``config`` on ``device`` (reads weight headers for ``no_change``).

    Raises:
        PrecisionError: see :func:`~.precision.resolve_precision`.
    """
    stored = torch.float32
    if config.base_model_precision == "no_change" and config.model_path:
        stored = stored_dtype(config.model_path)
    elif config.base_model_precision == "no_change" and config.model_file:
        stored = stored_file_dtype(config.model_file)
    return resolve_precision(config.base_model_precision, config.mixed_precision, device, stored)


def load_bundle(config: TrainConfig, precision: Precision | None = None,
                log: Callable[[str], None] = print) -> ModelBundle:
    """The model of ``config``: a local folder when ``model_path`` is set, one ``.safetensors`` file
    when ``model_file`` is (both loaded straight into the run's storage dtype; a file's family,
    layout and variant go to ``log``), else the preset (random init in fp32; training casts it).

    Raises:
        ModelLoadError: the folder or file cannot be used (named, with what was found).
    """
    precision = precision or run_precision(config, resolve_device(config))
    if config.model_path:
        bundle = load_model_folder(config.model_path, config.family, config.vae_path,
                                   config.text_encoder_path, seed=config.seed, dtype=precision.storage_dtype)
    elif config.model_file:
        bundle = load_model_file(config.model_file, config.family, config.vae_path, config.text_encoder_path,
                                 seed=config.seed, dtype=precision.storage_dtype, log=log)
    else:
        bundle = build_preset(config.family, config.preset, seed=config.seed, text_encoders=config.text_encoder_path)
    return dataclasses.replace(bundle, base_precision=config.base_model_precision)
