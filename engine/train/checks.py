"""What a run checks before any model is built: the paths it reads, the device, the output folder
and, when resuming, the saved state it continues."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..config import (
    RESUME_KEYS,
    SAVED_BEFORE,
    ConfigError,
    DataConfig,
    LoraSettings,
    ModelConfig,
    ObjectiveConfig,
    ShardingConfig,
    TrainConfig,
)
from ..config.train import warn_resume_schedule
from ..data.checks import check_dataset
from ..data.fingerprint import input_changes
from ..data.folder import DatasetScan
from ..data.limits import check_resolution, model_shape
from ..data.precheck import check_paths, check_saved_run, precheck
from ..data.windows import check_clip_frames
from ..families import get_family
from ..families.comfyui import LAYOUT_MODULES
from ..files.checks import is_gguf
from ..model.adapters import adapter_layers
from ..model.bundle import ModelBundle
from ..model.comfy_lora import base_shapes, comfy_naming
from ..model.layouts import LayoutError, get_layout
from ..model.lora_files import add_lora
from ..model.quantized.gguf_file import check_transformer, open_gguf
from ..model.single_file import transformer_keys
from .state import read_state_header


def _need(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: allowed {allowed}.")


def check_input_paths(config: TrainConfig) -> DatasetScan | None:
    """Check the paths the run reads (model, VAE, text encoder, data, init LoRA) before any
    model is built: :func:`~..data.precheck.check_paths`, then a GGUF ``model_file`` (with the
    ``gguf`` library) and the data folder's captions decoded and images read through
    (``engine/data/checks.py`` ``check_dataset``).

    Returns:
        The checked scan of the data folder (None without one).

    Raises:
        ConfigError: a folder does not exist; ``model_file`` is not a ``.safetensors`` or ``.gguf``
            file, or is a LoRA; ``init_lora`` holds no LoRA, or one of another family or rank (both named).
        DamagedFileError: ``model_file`` or ``init_lora`` is truncated, unreadable or not a
            safetensors (or GGUF) file (a text file, a pickle).
        ModelLoadError: a GGUF ``model_file`` of another architecture, or holding a tensor type
            not loaded (one line naming the file).
        DatasetError: a caption cannot be decoded, an image is not one or is truncated (named).
    """
    check_paths(config.model, config.data.folder, config.lora, config.outputs.resume)
    return _check_read_inputs(config.model.model_file, config.data.folder)


def _check_read_inputs(model_file: str | None, data_folder: str | None) -> DatasetScan | None:
    """What :func:`check_input_paths` adds to :func:`~..data.precheck.check_paths`: a GGUF
    ``model_file`` read, the data's images read through."""
    if model_file is not None and is_gguf(model_file):  # complete, of a diffusion architecture and of loaded types
        opened = open_gguf(model_file)
        check_transformer(opened, transformer_keys(opened.tensors))
    return check_dataset(data_folder)


def check_lora_format(model: ModelConfig, lora: LoraSettings, lora_format: str, bundle: ModelBundle | None = None) -> None:
    """Refuse ``lora_format=comfyui`` for a family whose released layout is not mapped here (its
    LoRA could not be named as ComfyUI names it; ``both`` writes the diffusers file alone there).

    Raises:
        ConfigError: naming the family and the families that have a layout.
    """
    family = bundle.family.name if bundle is not None else model.family
    if lora_format == "comfyui" and family is not None and family not in LAYOUT_MODULES:
        raise ConfigError(f"lora_format='comfyui' is invalid for family {family!r}: its released layout is not mapped "
                          f"here (comfyui files: {', '.join(sorted(LAYOUT_MODULES))}); allowed diffusers or both "
                          "(see segckpt families, column 'LoRA applied in ComfyUI')")
    if lora.lora_type == "lokr" and lora_format != "diffusers" and family in LAYOUT_MODULES:
        _check_comfy_lokr(model, lora, lora_format, bundle)


def _check_comfy_lokr(model_config: ModelConfig, lora: LoraSettings, lora_format: str, bundle: ModelBundle | None) -> None:
    """Refuse a LoKr whose ComfyUI file could not apply it exactly (a fused or reordered weight of a
    family whose diffusers names ComfyUI does not map: ``engine/model/comfy_lora.py`` ``comfy_naming``),
    from the model's config on the ``meta`` device: no weight is read.

    Raises:
        ConfigError: naming the weight and the formats that can hold the adapter.
    """
    shape = model_shape(model_config, bundle)
    if shape is None:
        return  # the loader names what is wrong with the model's files
    family = shape.family
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family.model_cls().from_config(shape.config)
        add_lora(model, lora, family.lora_targets, family)
    try:
        comfy_naming(get_layout(family.name), base_shapes(model), list(adapter_layers(model)), "lokr")
    except LayoutError as exc:
        raise ConfigError(f"lora_format={lora_format!r} is invalid: {exc}") from None


def check_guidance(objective: ObjectiveConfig, model: ModelConfig, bundle: ModelBundle | None = None) -> None:
    """Refuse a ``guidance_value`` other than 1 for a model without a guidance embedder (a
    guidance-distilled family's undistilled checkpoints: FLUX.1-schnell, Flux.2 Klein), read from
    its config before it is built (``bundle``: the model a caller loaded, read from it).

    Raises:
        ConfigError: naming the value and the model's ``guidance_embeds``.
    """
    value = objective.guidance_value
    if value == 1.0:
        return
    shape = model_shape(model, bundle)
    if shape is not None and not shape.config.get("guidance_embeds", False):
        raise ConfigError(f"guidance_value={value!r} is invalid for this {shape.family.name} model ({shape.source}): "
                          "allowed 1 (its config has guidance_embeds false: no guidance input, as FLUX.1-schnell "
                          "and Flux.2 Klein).")


def check_run(config: TrainConfig, prepared: bool = False, bundle: ModelBundle | None = None) -> None:
    """Check what :func:`~..data.precheck.precheck` checks before any heavy import (paths, the
    output folder, the frame rule, a machine without CUDA), then the inputs' contents
    (:func:`check_input_paths`), the resolution against the model's limits
    (:func:`~..data.limits.check_resolution`), device and saved state before any heavy work.

    Args:
        prepared: the run trains on data a caller prepared (ComfyUI's latents), not a folder.
        bundle: the model, when the caller already loaded it (its config is read instead).

    Raises:
        ConfigError: see :func:`~..data.precheck.precheck` and :func:`check_input_paths`;
            ``device=cuda`` without CUDA; ``resume``
            without a saved state or with options that differ from it (:data:`~..config.RESUME_KEYS`),
            or fewer steps than already done; a run already in ``output`` without ``resume``
            or ``overwrite`` (nothing a user made is replaced silently).
        ConfigError: ``prepared`` with a data folder or with buckets; a ``resolution`` past the
            model's position tables (the option and the largest allowed value named).
        DamagedFileError, DatasetError: see :func:`check_input_paths`.
        FolderInUseError, OutputWriteError: see :func:`~..data.precheck.check_output_place`.
    """
    precheck(config, prepared)  # what the options and the disk alone refuse, before any heavy import
    scan = _check_read_inputs(config.model.model_file, config.data.folder)
    check_lora_format(config.model, config.lora, config.outputs.lora_format, bundle)
    check_guidance(config.objective, config.model, bundle)
    if not prepared:
        check_resolution(config.model, config.data, config.validation.validation_frames, bundle)
        family = bundle.family if bundle is not None else get_family(config.model.family)
        check_clip_frames(scan, config.data, family)  # every clip too short: refused
    _need(config.model.device != "cuda" or torch.cuda.is_available(), "device", config.model.device,
          "auto or cpu (CUDA is not available here)")
    check_output(config)


PATH_KEYS = ("model_path", "model_file", "vae_path", "text_encoder_path", "data", "init_lora")
"""Options naming files or folders: a resume compares where they point, not how they are spelled."""


def _path(key: str, value):
    """``value`` of ``key`` as the place it names (``data/``, ``./data`` and the absolute path are one)."""
    if key not in PATH_KEYS or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [os.path.realpath(v) for v in value]
    return os.path.realpath(value)


def check_output(config: TrainConfig) -> None:
    """Check the output folder against the run: without ``resume`` it holds no run (or
    ``overwrite`` is set); with it, its saved state continues this run. A run checks it again
    once it holds the folder's lock (``engine/files/lock.py``), so two runs started together
    cannot both find it empty.

    Raises:
        ConfigError: see :func:`check_run`.
    """
    outputs = config.outputs
    check_saved_run(outputs)
    if not outputs.resume:
        return
    header = read_state_header(outputs.output)
    saved, now = header["config"], json.loads(json.dumps(config.to_dict(), default=str))
    # a state saved before a key existed ran with its default then (SAVED_BEFORE), else its default now
    defaults = {**TrainConfig().to_dict(), **SAVED_BEFORE}
    for key in RESUME_KEYS:
        if key == "data" and "data" in header["inputs"]:  # the fingerprint compares the folder's content
            continue
        before = saved.get(key, defaults.get(key))
        if isinstance(before, dict):  # a nested component (lora) saved before one of its keys existed
            before = {**defaults.get(key, {}), **before}
        if _path(key, before) != _path(key, now.get(key)):
            raise ConfigError(f"resume: {key}={now.get(key)!r} differs from the saved run's "
                              f"{before!r}; allowed the saved value (or start a new run)")
    _need(config.steps >= header["step"], "steps", config.steps,
          f"at least the {header['step']} steps already done in {outputs.output}")
    check_global_batch(config.data, config.sharding, saved)
    warn_resume_schedule(config, saved.get("steps"), header["step"])


def processes(sharding: ShardingConfig) -> int:
    """The processes a run trains on: torchrun's ``WORLD_SIZE`` with fsdp or ddp (1 when unset or
    not a number: the launch check names it), else 1."""
    world = os.environ.get("WORLD_SIZE", "1") if sharding.kind else "1"
    return int(world) if world.isdigit() and int(world) > 0 else 1


def saved_global_batch(saved: dict) -> int:
    """The global batch of a saved run's config: ``global_batch_size``, else ``batch_size`` times
    its ``processes`` (a state saved before the per-process batch has no ``processes``: its
    ``batch_size`` was the global batch)."""
    if saved.get("global_batch_size") is not None:
        return int(saved["global_batch_size"])
    return int(saved.get("batch_size", 1)) * int(saved.get("processes", 1))


def check_global_batch(data: DataConfig, sharding: ShardingConfig, saved: dict) -> None:
    """A resumed run draws the saved run's global batch (its data position counts those batches).

    Raises:
        ConfigError: another global batch, naming the per-process batch and the processes.
    """
    world = processes(sharding)
    part, batch = data.batch_rows(world)
    before = saved_global_batch(saved)
    if batch != before:
        allowed = (f"batch_size={before // world} per process or global_batch_size={before}" if before % world == 0
                   else f"a number of processes that divides {before}")
        raise ConfigError(f"resume: batch_size={part} on {world} process(es) is a global batch of {batch}, which "
                          f"differs from the saved run's {before}; allowed {allowed} (or start a new run)")


class ResumeWarning(UserWarning):
    """A resumed run continues although its data changed (``on_data_change=new_epoch``)."""


def check_resume_inputs(output: Path, inputs: dict[str, Any], data_folder: str | None,
                        on_data_change: str) -> dict[str, Any] | None:
    """Compare what the options point at now (``inputs``: their fingerprint,
    ``engine/data/fingerprint.py``) with the fingerprint saved in ``output``'s state: a model that
    differs is refused; data that differ are refused, or with ``on_data_change=new_epoch``
    continued from the next epoch in a fresh order (what changed is returned for the report:
    ``{"changes", "step", "fresh_epoch"}``; None: nothing changed).

    Raises:
        ConfigError: naming what changed and what is allowed.
    """
    header = read_state_header(output)
    data, model = input_changes(header["inputs"], inputs)
    if model:
        raise ConfigError(f"resume: {'; '.join(model)}; allowed the model the saved run trained on (or start "
                          "a new run)")
    if not data:
        return None
    where = data_folder or "the prepared data"
    if on_data_change == "refuse":
        raise ConfigError(f"resume: the data in {where} changed since the state of step {header['step']} was "
                          f"saved: {', '.join(data)}; the saved epoch position would skip or repeat images. "
                          "Allowed: the same data, or on_data_change=new_epoch (--on-data-change new_epoch) to "
                          "continue with a fresh epoch order")
    epoch = int(header["data_position"].get("epoch", 0)) + 1
    warnings.warn(f"resume: the data in {where} changed since step {header['step']} ({', '.join(data)}); "
                  f"continuing with a fresh epoch order from epoch {epoch} (on_data_change=new_epoch)",
                  ResumeWarning, stacklevel=3)
    return {"changes": data, "step": header["step"], "fresh_epoch": epoch}
