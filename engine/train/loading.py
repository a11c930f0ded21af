"""Loading a model: a diffusers folder at a local path, or a tiny random-init preset by family name
(one ``.safetensors`` file: :mod:`.single_file`).

Nothing here ever touches the network: folders are loaded with ``local_files_only=True`` and
only ``.safetensors`` weights are accepted (pickle checkpoints can run code when loaded, so they
are refused with a message saying how to convert them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import diffusers
import safetensors
import torch
from safetensors import safe_open

from ..families import FamilyAdapter, TextBatch, family_for_class, get_family
from .file_checks import DamagedFileError, check_safetensors
from .text import DeterministicTextEmbedder, load_text_encoders

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
PRESETS = ("tiny",)
SAFETENSORS_FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                     "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F64": torch.float64}


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
    """

    family: FamilyAdapter
    transformer: torch.nn.Module
    vae: torch.nn.Module | None
    encode_text: Callable[[list[str]], TextBatch]
    source: str
    base_precision: str | None = None


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


def build_preset(family_name: str, preset: str = "tiny", seed: int = 0,
                 overrides: dict[str, Any] | None = None,
                 text_encoders: Sequence[str | Path] | None = None) -> ModelBundle:
    """A random-init model of ``family_name`` from its tiny preset (deterministic for a seed).

    Args:
        family_name: a registered family.
        preset: only ``tiny`` is defined.
        seed: seed of the random init.
        overrides: config keys replacing the preset's (e.g. ``{"num_layers": 4}``).
        text_encoders: local text encoder folders (:func:`~.text.load_text_encoders`; their
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
    vae = diffusers.AutoencoderKL(**tiny_vae_config(family.latent_channels))
    spec = family.text(transformer.config)
    embedder = (load_text_encoders(text_encoders, family, spec) if text_encoders
                else DeterministicTextEmbedder(spec, seed=seed))
    return ModelBundle(family, transformer.eval(), vae.eval(), embedder, f"preset:{preset}")


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
    root = Path(path)
    folder = root / "transformer" if (root / "model_index.json").is_file() else root
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
    root = Path(path)
    folder = root / "transformer" if (root / "model_index.json").is_file() else root
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
    :func:`~.text.load_text_encoders`) replaces the pipeline's encoders; without any, the
    deterministic stand-in embedder is used.

    Raises:
        ModelLoadError: missing folder, pickle-only weights, a class other than the family's,
            or no VAE.
        TextEncoderError: the text encoder folders do not serve the family.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a folder")
    pipeline = (root / "model_index.json").is_file()
    transformer_dir = root / "transformer" if pipeline else root
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
    transformer = _load_component(transformer_dir, family.model_class, dtype)
    vae_dir = Path(vae_path) if vae_path else (root / "vae" if pipeline else None)
    if vae_dir is None or not vae_dir.is_dir():
        raise ModelLoadError(f"no VAE for {root}: pass a pipeline folder with vae/ or a vae path")
    if isinstance(text_encoder_path, (str, Path)):
        text_encoder_path = [text_encoder_path]
    text_dirs = [Path(p) for p in text_encoder_path or []]
    if not text_dirs and pipeline:  # text_encoder, text_encoder_2, ...: the pipeline's order (CLIPs first)
        text_dirs = sorted(p for p in root.glob("text_encoder*") if p.is_dir())
    return assemble_bundle(family, transformer, str(root), vae_dir, text_dirs, seed)


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
