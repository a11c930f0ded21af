"""Loading a diffusers model folder at a local path (a pipeline with ``transformer/``, ``vae/`` and
``text_encoder*/``, or a bare transformer with a VAE folder beside it).

Nothing here ever touches the network: folders are loaded with ``local_files_only=True`` and
only ``.safetensors`` weights are accepted (pickle checkpoints can run code when loaded, so they
are refused with a message saying how to convert them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import diffusers
import safetensors
import torch
from safetensors import safe_open

from ..families import FamilyAdapter, family_for_class, get_family
from ..families.scheduler_config import SchedulerConfigError, scheduler_settings
from ..files.checks import DamagedFileError, check_safetensors
from .bundle import ModelBundle, ModelLoadError
from .text_encoders import DeterministicTextEmbedder, load_text_encoders

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                     "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F64": torch.float64}


def check_safetensors_folder(folder: Path) -> None:
    """Refuse a component folder that has no ``.safetensors`` weights.

    Raises:
        ModelLoadError: the folder holds pickle weights only, no weights at all, or a damaged
            ``.safetensors`` file.
    """
    names = [p.name for p in folder.iterdir() if p.is_file()]
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if weights:
        for name in weights:  # a truncated download fails here, named, not deep inside a loader
            try:
                check_safetensors(folder / name, "model weights", "download or copy the file again")
            except DamagedFileError as exc:
                raise ModelLoadError(str(exc)) from exc
        return
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ModelLoadError(
            f"{folder} holds pickle weights ({', '.join(sorted(pickles))}): refused, because loading "
            "a pickle can run arbitrary code. Convert them to .safetensors (e.g. load once in a "
            "trusted environment and save_pretrained(..., safe_serialization=True)).")
    raise ModelLoadError(f"{folder} has no .safetensors weights")


def transformer_folder(root: str | Path) -> Path:
    """The folder of the transformer's ``config.json`` and weights: ``root/transformer`` of a
    pipeline folder (one with ``model_index.json``), else ``root`` itself."""
    root = Path(root)
    return root / "transformer" if (root / "model_index.json").is_file() else root


def vae_folder(root: str | Path, vae_path: str | Path | None) -> Path | None:
    """The VAE's folder: ``vae_path`` when given, else a pipeline folder's ``vae/`` (None for a
    bare transformer folder)."""
    root = Path(root)
    return Path(vae_path) if vae_path else (root / "vae" if (root / "model_index.json").is_file() else None)


def _class_name(folder: Path) -> str:
    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{folder} is not a diffusers model folder: no config.json")
    return json.loads(config.read_text(encoding="utf-8")).get("_class_name", "")


def _load_component(folder: Path, expected: str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    name = _class_name(folder)
    if expected is not None and name != expected:
        raise ModelLoadError(f"{folder} holds a {name or 'model of unknown class'}, not the "
                             f"{expected} the requested family needs")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ModelLoadError(f"{folder}: class {name!r} is not a diffusers model class")
    check_safetensors_folder(folder)
    return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True, torch_dtype=dtype).eval()


def stored_dtype(path: str | Path) -> torch.dtype:
    """The floating dtype most of the transformer's weights are stored in (headers only).

    Raises:
        ModelLoadError: no readable ``.safetensors`` weights.
    """
    folder = transformer_folder(path)
    counts: dict[str, int] = {}
    try:
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as fh:
                for key in fh.keys():
                    part = fh.get_slice(key)
                    counts[part.get_dtype()] = counts.get(part.get_dtype(), 0) + math.prod(part.get_shape())
    except (OSError, safetensors.SafetensorError) as exc:
        raise ModelLoadError(f"{folder}: the .safetensors weights could not be read: {exc}") from exc
    floating = {k: v for k, v in counts.items() if k in SAFETENSORS_FLOAT}
    if not floating:
        raise ModelLoadError(f"{folder} has no floating-point .safetensors weights")
    return SAFETENSORS_FLOAT[max(floating, key=floating.get)]


def detect_family(path: str | Path) -> str:
    """The family of the diffusers folder at ``path``, from its config (no weights are read).

    Raises:
        ModelLoadError: no config, unreadable config, or a class no adapter handles.
    """
    folder = transformer_folder(path)
    try:
        found = _class_name(folder)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    family = family_for_class(found)
    if family is None:
        raise ModelLoadError(f"{folder} holds a {found!r}, which no family adapter handles")
    return family.name


def load_model_folder(path: str | Path, family_name: str | None = None,
                      vae_path: str | Path | None = None,
                      text_encoder_path: str | Path | Sequence[str | Path] | None = None, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> ModelBundle:
    """Load a diffusers folder from a local path (never the network).

    The transformer is loaded in ``dtype`` (the run's storage dtype: a 12 B-parameter base never
    exists in fp32 when bf16 was asked for); the VAE stays fp32 (it encodes the data once).

    ``path`` is either a pipeline folder (``model_index.json`` with ``transformer/`` and ``vae/``
    subfolders, optionally ``text_encoder*/`` + ``tokenizer*/``) or a bare transformer folder (then
    ``vae_path`` is required). ``text_encoder_path`` (one folder or several, see
    :func:`~.text_encoders.load_text_encoders`) replaces the pipeline's encoders; without any, the
    deterministic stand-in embedder is used.

    Raises:
        ModelLoadError: missing folder, pickle-only weights, a class other than the family's,
            no VAE, or a ``scheduler/scheduler_config.json`` that cannot be read.
        TextEncoderError: the text encoder folders do not serve the family.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a folder")
    pipeline = (root / "model_index.json").is_file()
    transformer_dir = transformer_folder(root)
    found = _class_name(transformer_dir)
    if family_name is None:
        family = family_for_class(found)
        if family is None:
            raise ModelLoadError(f"{transformer_dir} holds a {found!r}, which no family adapter handles")
    else:
        family = get_family(family_name)
        if found != family.model_class:
            raise ModelLoadError(f"{transformer_dir} holds a {found!r} but family {family.name!r} "
                                 f"needs a {family.model_class!r}")
    try:  # read before the weights: a damaged file is named at once
        scheduler = scheduler_settings(family.flow_shift, root) if family.objective == "flow" else None
    except SchedulerConfigError as exc:
        raise ModelLoadError(str(exc)) from exc
    transformer = _load_component(transformer_dir, family.model_class, dtype)
    vae_dir = vae_folder(root, vae_path)
    if vae_dir is None or not vae_dir.is_dir():
        raise ModelLoadError(f"no VAE for {root}: pass a pipeline folder with vae/ or a vae path")
    if isinstance(text_encoder_path, (str, Path)):
        text_encoder_path = [text_encoder_path]
    text_dirs = [Path(p) for p in text_encoder_path or []]
    if not text_dirs and pipeline:  # text_encoder, text_encoder_2, ...: the pipeline's order (CLIPs first)
        text_dirs = sorted(p for p in root.glob("text_encoder*") if p.is_dir())
    bundle = assemble_bundle(family, transformer, str(root), vae_dir, text_dirs, seed)
    bundle.scheduler = scheduler
    return bundle


def assemble_bundle(family: FamilyAdapter, transformer: torch.nn.Module, source: str, vae_dir: Path | None,
                    text_dirs: Sequence[Path], seed: int = 0) -> ModelBundle:
    """A :class:`ModelBundle` of a loaded transformer: the VAE of ``vae_dir`` (fp32; ``None``: no
    VAE) and the text encoders of ``text_dirs`` (none: the deterministic stand-in embedder).

    Raises:
        ModelLoadError: the VAE folder is not a diffusers model folder with ``.safetensors`` weights.
        TextEncoderError: the text encoder folders do not serve the family.
    """
    vae = _load_component(vae_dir) if vae_dir is not None else None
    spec = family.text(transformer.config)
    encode = load_text_encoders(text_dirs, family, spec) if text_dirs else DeterministicTextEmbedder(spec, seed=seed)
    return ModelBundle(family, transformer, vae, encode, source)
