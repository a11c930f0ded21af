"""The refusals a run decides from its options and the disk alone, answered before torch,
diffusers or any model library is imported (issue 34: each used to wait 5 s on an idle machine,
35-64 s on a busy one, for imports it did not need).

:func:`precheck` runs first in ``engine/train/checks.py`` ``check_run`` and, in ``segckpt``, before
the command imports anything heavy. It refuses: a folder or file the options name that does not
exist (a ``.safetensors`` model file's header too: complete, not a LoRA); an output folder that is a
file, the data folder or inside it, that another live run holds (its lock, ``engine/files/lock.py``,
answers before the resume checks), that cannot be written, or that holds a run without ``--resume``
or ``--overwrite`` (or none to resume); a data folder with no image or clip
(``engine/data/folder.py``'s scan, captions decoded; the images are read through by the run's own
checks, ``engine/data/checks.py``); a frame count the family's frame rule does not take
(``engine/families/frames.py``; the model's own bound on frames needs its config and is checked in
``engine/data/limits.py``); ``caption_dropout`` on prepared data (no text encoder of ours encoded
it); an ``optimizer`` whose package is not installed (``engine/config/optim.py``
``optimizer_provider``: found, not imported); and ``device=cuda`` where this machine certainly has
no CUDA (:func:`cuda_absent`; where it may have one, torch decides in ``check_run``).

Every module this one imports imports no heavy library (``tests/test_startup.py`` holds the command
line to it with an import hook).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..config import ConfigError, DataConfig, LoraSettings, ModelConfig, OptimizerConfig, OutputConfig, TrainConfig
from ..config.optim import optimizer_provider
from ..config.outputs import STATE_FILE
from ..families import FamilyAdapter, family_names, get_family
from ..files.atomic import check_writable
from ..files.checks import is_gguf, safetensors_header
from ..files.lock import check_free
from ..model.lora_header import check_init_lora, check_not_a_lora
from .folder import scan_dataset

CUDA_SIGNS = ("/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")
"""Paths any CUDA (or ROCm, which torch also calls ``cuda``) device of a Linux machine shows:
the NVIDIA kernel module's ``/proc`` entry (present whenever its driver is loaded, in containers
too), WSL2's GPU paravirtualisation device and ROCm's compute device; besides them, every
``/dev/nvidia*``, ``/dev/nvhost*`` (Jetson), ``/dev/nvmap`` and ``/dev/nvgpu*`` node counts."""
CUDA_NODE_PREFIXES = ("nvidia", "nvhost", "nvmap", "nvgpu")


def _need(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: allowed {allowed}.")


def precheck(config: TrainConfig, prepared: bool = False, family_known: bool = True) -> None:
    """Refuse what the options and the disk alone show is wrong (see the module docstring), before
    any heavy import.

    Args:
        prepared: the run trains on data a caller prepared (ComfyUI's latents), not a folder.
        family_known: ``config.model.family`` is the run's (False while ``segckpt`` has not yet
            read it from the model folder: the frame rule and ``init_lora``'s family wait).

    Raises:
        ConfigError: see :func:`check_paths`, :func:`check_output_place`, :func:`check_frame_counts`;
            ``device=cuda`` on a machine without CUDA; ``caption_dropout`` with prepared data; an
            ``optimizer`` whose package is not installed.
        FolderInUseError: another live run holds the output folder.
        OutputWriteError: the output folder cannot be written.
        DamagedFileError: ``model_file`` or ``init_lora`` is missing, truncated or not a safetensors file.
        DatasetError: the data folder holds no image or clip, or a caption cannot be decoded.
    """
    if prepared and config.data.folder is not None:
        raise ConfigError(f"data={config.data.folder!r} is invalid with prepared data: allowed unset (one data "
                          "source)")
    if prepared and config.data.buckets:  # ComfyUI's LATENT is one batch of one latent shape
        raise ConfigError("buckets=True is invalid with prepared data (ComfyUI LATENT + CONDITIONING: one batch of "
                          "one latent shape): allowed false; bucketing needs an image folder")
    if prepared and config.data.caption_dropout > 0:  # no text encoder of ours encoded its captions
        raise ConfigError(f"caption_dropout={config.data.caption_dropout!r} is invalid with prepared data (ComfyUI "
                          "conditioning): allowed 0; the empty caption must be encoded by the text encoder that "
                          "encoded the captions, which needs an image folder (dataset)")
    check_optimizer(config.optimizer, config.model)
    check_paths(config.model, config.data.folder, config.lora, config.outputs.resume, family_known)
    check_output_place(config.outputs, config.data.folder, bool(config.sharding.kind))
    if config.data.folder is not None:
        scan_dataset(config.data.folder)  # no image or clip, an undecodable caption
    if family_known and not prepared:
        check_frame_counts(config.data, config.validation.validation_frames, get_family(config.model.family))
    _need(config.model.device != "cuda" or not cuda_absent(), "device", config.model.device,
          "auto or cpu (CUDA is not available here: this machine has no NVIDIA, WSL or ROCm GPU device)")


def check_optimizer(optim: OptimizerConfig, model: ModelConfig) -> None:
    """Refuse an ``optimizer`` whose package is not installed here, on the run's device (``cpu``
    when ``device`` is cpu or this machine has no CUDA, :func:`cuda_absent`; else ``cuda``): found,
    not imported (``engine/config/optim.py`` ``optimizer_provider``). The Train LoRA node asks it
    when queued, before its model loads.

    Raises:
        ConfigError: one line naming ``optimizer``, its value and the pip command that installs it.
    """
    optimizer_provider(optim.name, "cpu" if model.device == "cpu" or cuda_absent() else "cuda")


def check_paths(model: ModelConfig, data_folder: str | None, lora: LoraSettings, resume: bool,
                family_known: bool = True) -> None:
    """Refuse a folder or file the options name that does not exist: ``model_path``, ``vae_path``,
    ``data``, ``text_encoder_path``; a ``model_file`` that is no ``.safetensors`` or ``.gguf``
    file, or a ``.safetensors`` one that is damaged or a LoRA (its header; a GGUF file is read
    in ``engine/train/checks.py``, with the ``gguf`` library); an ``init_lora`` that is damaged, or (``family_known``)
    of another family or rank (``engine/model/lora_header.py``).

    Raises:
        ConfigError, DamagedFileError: naming the key and the path.
    """
    for key, value in (("model_path", model.model_path), ("vae_path", model.vae_path), ("data", data_folder)):
        _need(value is None or Path(value).is_dir(), key, value, "an existing folder")
    for value in model.text_encoder_path or ():
        _need(Path(value).is_dir(), "text_encoder_path", value, "existing folders")
    if model.model_file is not None:
        _need(model.model_file.endswith((".safetensors", ".gguf")) and Path(model.model_file).is_file(),
              "model_file", model.model_file, "an existing .safetensors or .gguf file (pickle checkpoints are "
              "refused: loading one can run arbitrary code)")
        if not is_gguf(model.model_file):
            header = safetensors_header(model.model_file, "model_file", "download or copy the file again")
            check_not_a_lora(model.model_file, header)
    if model.init_lora is not None and family_known and not resume:  # a resume continues its state
        check_init_lora(model.init_lora, model.family, lora.rank, lora.lora_type)


def check_output_place(outputs: OutputConfig, data_folder: str | None, sharded: bool) -> None:
    """Refuse an output folder the run cannot have: a file; the data folder or a folder inside it
    (the LoRA, state, previews and cache written there would be read as training data by the next
    scan); one another live run holds (``engine/files/lock.py``: answered before any resume check,
    naming the holder; asked by torchrun's rank 0 alone under fsdp or ddp, the rank that takes the lock,
    which the other ranks may otherwise find held); one this process cannot write; one that holds
    a run, or none to resume (:func:`check_saved_run`).

    Raises:
        ConfigError: a file, inside the data folder, a run there or none to resume. FolderInUseError:
            held by a live run. OutputWriteError: not writable (``engine/files/atomic.py`` ``check_writable``).
    """
    output, data = outputs.output, data_folder
    _need(not Path(output).exists() or Path(output).is_dir(), "output", output, "a folder")
    if data is not None and inside(output, data):
        raise ConfigError(f"output={output!r} is invalid with data={data!r}: allowed a folder outside the data folder "
                          "(the LoRA, state, previews and cache written there would be read as training data)")
    if not sharded or os.environ.get("RANK", "0") == "0":  # torchrun's rank 0 takes the lock
        check_free(output)
    check_writable(output, "output")
    check_saved_run(outputs)


def check_saved_run(outputs: OutputConfig) -> None:
    """Refuse an output folder that holds a run (its training state) without ``resume`` or
    ``overwrite``, and ``resume`` where it holds none. ``engine/train/checks.py`` ``check_output``
    checks it again holding the folder's lock, then compares a resumed run with its saved state.

    Raises:
        ConfigError: naming the folder (or ``resume``) and what to pass.
    """
    state = Path(outputs.output) / STATE_FILE
    if not outputs.resume:
        _need(outputs.overwrite or not state.is_file(), "output", outputs.output,
              "a folder without a training run: it holds one; pass --resume to continue it or "
              "--overwrite to replace it")
    else:
        _need(state.is_file(), "resume", True, f"only when {state} exists (run without --resume first)")


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it, links resolved (``data/out``, ``./data``
    and a link to ``data`` all count)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def check_frame_counts(data: DataConfig, validation_frames: int | None, family: FamilyAdapter,
                       most: int | None = None) -> None:
    """Refuse the frame counts of ``data`` (``frame_buckets``, else ``num_frames``; and
    ``validation_frames`` of a video family) that ``family``'s frame rule does not take, or
    (``most``) past the model's bound.

    Raises:
        ConfigError: the first count refused (:func:`check_frame_count`).
    """
    for count in data.frame_buckets or ():
        check_frame_count(family, "frame_buckets", count, most)
    if not data.frame_buckets:
        check_frame_count(family, "num_frames", data.num_frames, most)
    if validation_frames is not None and family.frames is not None:
        check_frame_count(family, "validation_frames", validation_frames, most)


def check_frame_count(family: FamilyAdapter, key: str, frames: int, most: int | None = None) -> None:
    """Refuse a pixel-frame count the family's VAE rule does not take (``engine/families/frames.py``).

    Raises:
        ConfigError: ``num_frames=16 is invalid for wan: allowed 4k+1 (13, 17, ...)``; an image
            family: ``allowed 1 (wan ... take clips)``; past ``most``: ``allowed at most 129``.
    """
    rule = family.frames
    if rule is None:
        if frames != 1:
            video = ", ".join(n for n in family_names() if get_family(n).frames is not None)
            raise ConfigError(f"{key}={frames} is invalid for {family.name}: allowed 1 ({family.name} is an image "
                              f"family; the video families take clips: {video})")
        return
    if not rule.allows(frames):
        near = ", ".join(str(n) for n in rule.nearest(frames, most))
        raise ConfigError(f"{key}={frames} is invalid for {family.name}: allowed {rule.formula} ({near}, ...)")
    if most is not None and frames > most:
        raise ConfigError(f"{key}={frames} is invalid for {family.name}: allowed at most {most} pixel frames "
                          f"({rule.latent_frames(most)} latent frames, the model's limit)")


def cuda_absent() -> bool:
    """Whether this machine certainly has no CUDA device, decided without torch: macOS (no CUDA
    build exists), or Linux with none of :data:`CUDA_SIGNS` and no NVIDIA device node in ``/dev``.
    False (maybe) anywhere else: torch then decides (``engine/train/checks.py``), and a torch
    built without CUDA on a machine with a GPU is refused there."""
    if sys.platform == "darwin":
        return True
    if not sys.platform.startswith("linux"):
        return False
    if any(os.path.exists(p) for p in CUDA_SIGNS):
        return False
    try:
        return not any(name.startswith(CUDA_NODE_PREFIXES) for name in os.listdir("/dev"))
    except OSError:
        return False
