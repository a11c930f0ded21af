"""Single-file checkpoints: one ``.safetensors`` or GGUF file holding a transformer, loaded offline.

A file comes from ``models/diffusion_models`` (the transformer alone), ``models/unet`` or
``models/checkpoints`` (a full checkpoint: its transformer is the ``model.diffusion_model.`` part,
the prefix ComfyUI and diffusers both strip; the VAE and text encoders in it are not read). It may
be in the original release layout or the diffusers layout. The order of work:

1. the header is checked (:func:`~..files.checks.check_safetensors`, or
   :func:`~.quantized.gguf_file.open_gguf` for a GGUF file) and read: names, dtypes, shapes;
2. the family and layout are recognised from key names (:mod:`.single_file_formats`; ComfyUI's
   scaled fp8 marker and scale keys set aside, :mod:`.quantized.scaled_fp8`);
3. the header is converted to the diffusers layout on ``meta`` tensors (once per candidate config
   where the conversion needs the config: the UNet's), and its shapes are compared with the shipped
   configs of the family's released variants (``model_configs/*.json``) and the family's tiny
   preset; if none matches exactly, the config is inferred from the shapes where the
   family allows it, and the inferred model's shapes must match the file's exactly;
4. only then are the weights read, each cast to the run's storage dtype as it is read (an fp8,
   fp16 or bf16 file never exists in fp32 when bf16 was asked for; a scaled fp8 weight is
   dequantized; a GGUF file's quantized weights stay as they are stored), converted with the same
   function, and assigned to a model built without initialising its weights (a GGUF Linear
   weight's layer becoming a :class:`~.quantized.gguf_linear.GGUFLinear`).

Nothing touches the network: the configs ship with the pack, and no diffusers loader that could
fetch a default config is called.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import safetensors
import torch
from accelerate import init_empty_weights
from safetensors import safe_open

from ..families import FamilyAdapter, get_family
from ..files.checks import DamagedFileError, safetensors_header
from .bundle import ModelBundle, ModelLoadError
from .folders import SAFETENSORS_FLOAT, assemble_bundle
from .layouts import diffusers_converter, get_layout
from .lora_header import check_not_a_lora
from .precision import keeps_fp32
from .quantized import gguf_file, scaled_fp8
from .quantized.gguf_linear import GGUFWeight, assign_weights, is_gguf_weight
from .single_file_formats import FORMATS, RECOGNISED_ONLY, FileFormat, ShapeInferenceError, Shapes

PREFIX = "model.diffusion_model."
CONFIG_DIR = Path(__file__).with_name("model_configs")
TINY = "tiny preset"
INFERRED = "inferred from shapes"


@dataclass(frozen=True)
class Identified:
    """What a file holds, decided from its header.

    Attributes:
        family: the family adapter.
        layout: ``original`` (the release layout) or ``diffusers``.
        variant: a shipped variant's name (``flux1-dev``), :data:`TINY`, or :data:`INFERRED`.
        config: the diffusers config the model is built from.
    """

    family: FamilyAdapter
    layout: str
    variant: str
    config: dict[str, Any]

    def describe(self) -> str:
        """``flux, original layout, variant flux1-dev`` (for the load log)."""
        return f"{self.family.name}, {self.layout} layout, variant {self.variant}"


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{key: (dtype, shape)}`` of a complete ``.safetensors`` file (safetensors' dtype names) or
    GGUF file (GGUF's type names, ``Q8_0``, ``F32``, ...; torch shapes); no tensor is read.

    Raises:
        ModelLoadError: missing, truncated or unreadable file, or not a safetensors or GGUF file
            (named, with what to do); a GGUF tensor type no GGUF version defines.
        ConfigError: the file is a LoRA, not a model.
    """
    if gguf_file.is_gguf(path):
        return _open(path)[0]
    try:
        check_not_a_lora(path, safetensors_header(path, "model file", "download or copy the file again"))
        with safe_open(str(path), framework="pt") as fh:
            return {k: (fh.get_slice(k).get_dtype(), tuple(fh.get_slice(k).get_shape())) for k in fh.keys()}
    except (DamagedFileError, OSError, safetensors.SafetensorError) as exc:
        raise ModelLoadError(str(exc)) from exc


def transformer_keys(keys) -> dict[str, str]:
    """``{key without prefix: key in the file}`` of the transformer part: the keys under
    ``model.diffusion_model.`` when the file has any (a full checkpoint), else every key."""
    keys = list(keys)
    if any(k.startswith(PREFIX) for k in keys):
        return {k[len(PREFIX):]: k for k in keys if k.startswith(PREFIX)}
    return {k: k for k in keys}


def recognise(keys) -> tuple[FileFormat | None, str, str]:
    """``(format, family name, layout)`` of transformer keys (names only; the prefix stripped).

    ``format`` is ``None`` for a layout that is recognised but not loaded from a single file.

    Raises:
        ModelLoadError: no known layout; the message shows the first keys.
    """
    keys = set(keys)
    for family, key in RECOGNISED_ONLY:
        if key in keys:
            return None, family, "original"
    for fmt in FORMATS:  # the diffusers layout first: Chroma's keeps a key of its original layout
        if fmt.diffusers and all(k in keys for k in fmt.diffusers):
            return fmt, fmt.family, "diffusers"
        if any(k in keys for k in fmt.original):
            return fmt, fmt.family, "original"
    first = ", ".join(sorted(keys)[:4]) or "none"
    raise ModelLoadError(f"no known key layout: first keys {first} (known: the original or diffusers layout of "
                         f"{', '.join(f.family for f in FORMATS)})")


def shipped_variants(family: FamilyAdapter) -> dict[str, dict[str, Any]]:
    """``{variant name: config}`` of the family's shipped configs (``model_configs/<variant>.json``,
    architecture keys of the official diffusers ``transformer/config.json``), then its tiny preset."""
    found = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("_class_name") == family.model_class:
            found[path.stem] = {k: v for k, v in data.items() if not k.startswith("_")}
    found[TINY] = dict(family.tiny_config)
    return found


def model_shapes(family: FamilyAdapter, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the state dict of ``family``'s class built from ``config`` (on ``meta``:
    nothing is allocated)."""
    with torch.device("meta"):
        model = family.model_cls().from_config(dict(config))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _needs_config(fmt: FileFormat, family: FamilyAdapter) -> bool:
    """Whether the family's conversion takes the config converted for (:attr:`~.layouts.OriginalLayout.needs_config`)."""
    layout = get_layout(family.name)
    return fmt.convert is None and layout is not None and layout.needs_config


def _converter(fmt: FileFormat, family: FamilyAdapter, config: Mapping[str, Any] | None = None
               ) -> Callable[[dict], dict]:
    """Original layout -> diffusers layout for ``family`` (given ``config`` where the layout needs it)."""
    if fmt.convert is not None:
        return fmt.convert
    layout = get_layout(family.name)
    if layout is None:
        return diffusers_converter(family.model_class)
    if layout.needs_config:
        return lambda checkpoint: layout.from_original(checkpoint, config or {})
    return layout.from_original


def _converted_shapes(fmt: FileFormat, family: FamilyAdapter, shapes: Shapes,
                      config: Mapping[str, Any] | None = None) -> dict[str, tuple[int, ...]]:
    """The file's shapes in the diffusers layout (the conversion run on ``meta`` tensors; under
    ``config`` where the family's conversion needs one).

    Raises:
        ModelLoadError: the conversion fails (keys it needs are missing, or sizes it assumes).
    """
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    try:
        converted = _converter(fmt, family, config)(meta)
    except (KeyError, IndexError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"a {family.name} file in the original layout that its conversion to diffusers "
                             f"cannot read: {type(exc).__name__}: {exc}") from exc
    return {k: tuple(v.shape) for k, v in converted.items()}


def _first_difference(want: Shapes, have: Shapes) -> str:
    for key in sorted(set(want) | set(have)):
        if key not in have:
            return f"{key} missing"
        if key not in want:
            return f"{key} unexpected"
        if tuple(want[key]) != tuple(have[key]):
            return f"{key} is {tuple(have[key])}, not {tuple(want[key])}"
    return "none"


def identify(shapes: Shapes, family_name: str | None = None) -> Identified:
    """Family, layout and config of a transformer from its ``{key: shape}`` (prefix stripped).

    The variant is the first shipped config (then the tiny preset) whose model has exactly the
    file's keys and shapes; else the config the family infers from the shapes (over the first
    shipped config, which gives the keys no shape holds), if its model matches exactly.

    Raises:
        ModelLoadError: an unknown layout (naming what was seen); a family other than
            ``family_name`` (naming both); a layout not loaded from single files; no variant
            matches and the shapes do not determine a config (naming the variants expected).
    """
    try:
        fmt, found, layout = recognise(shapes)
    except ModelLoadError as exc:
        if family_name is None:
            raise
        raise ModelLoadError(f"{exc}; expected a {family_name} file") from exc
    if family_name is not None and found != family_name.lower():
        raise ModelLoadError(f"holds a {found} transformer ({layout} layout), not the {family_name} the family "
                             f"option asks for (set family to {found})")
    if fmt is None:
        raise ModelLoadError(f"holds a {found} transformer ({layout} layout); single files of family {found} are not "
                             f"loaded here (single-file families: {', '.join(f.family for f in FORMATS)}): use a "
                             "diffusers folder (model_path)")
    family = get_family(found)
    shapes = {k: tuple(v) for k, v in shapes.items()}
    per_config = layout == "original" and _needs_config(fmt, family)  # converted once per candidate config
    have = _converted_shapes(fmt, family, shapes) if layout == "original" and not per_config else shapes
    variants = shipped_variants(family)
    closest = ""
    for name, config in variants.items():
        if per_config:
            try:
                have = _converted_shapes(fmt, family, shapes, config)
            except ModelLoadError as exc:
                closest = closest or f"{name}: {exc}"
                continue
        want = model_shapes(family, config)
        if want == have:
            return Identified(family, layout, name, config)
        closest = closest or f"{name}: {_first_difference(want, have)}"
    reason = "the family's shapes do not determine a config"
    if fmt.infer is not None and not per_config:
        try:
            config = {**next(iter(variants.values())), **fmt.infer(have)}
            want = model_shapes(family, config)
            if want == have:
                return Identified(family, layout, INFERRED, config)
            reason = f"the inferred config does not match: {_first_difference(want, have)}"
        except ShapeInferenceError as exc:
            reason = str(exc)
    raise ModelLoadError(f"a {family.name} transformer ({layout} layout) of no known variant: expected one of "
                         f"{', '.join(variants)} (first difference, {closest}), and {reason}")


def _dtype_counts(header: Mapping[str, tuple[str, tuple[int, ...]]], keys) -> dict[str, int]:
    """Elements per floating safetensors dtype among ``keys`` of ``header``."""
    counts: dict[str, int] = {}
    for key in keys:
        dtype, shape = header[key]
        if dtype in SAFETENSORS_FLOAT:
            counts[dtype] = counts.get(dtype, 0) + int(torch.Size(shape).numel())
    return counts


def stored_file_dtype(path: str | Path) -> torch.dtype:
    """The floating dtype most of the file's transformer weights are stored in (header only).

    Raises:
        ModelLoadError: unreadable file, or no floating-point transformer weights.
    """
    header = read_header(path)
    counts = _dtype_counts(header, transformer_keys(header).values())
    if not counts:
        raise ModelLoadError(f"model file {str(path)!r} has no floating-point weights")
    return SAFETENSORS_FLOAT[max(counts, key=counts.get)]


def identify_file(path: str | Path, family_name: str | None = None) -> Identified:
    """:func:`identify` on the header of the file at ``path`` (its transformer part).

    Raises:
        ModelLoadError: see :func:`identify`, :func:`read_header` and :func:`_identify_part`; the
            message names the file.
    """
    header, gguf = _open(path)
    return _identify_part(path, header, family_name, gguf)[0]


def _identify_part(path, header, family_name, gguf=None) -> tuple[Identified, dict[str, str], dict[str, str]]:
    """:func:`identify` on ``header``'s transformer part; that part (``{key: key in the file}``,
    less the scale keys of a scaled fp8 file) and the scales (``{weight key: scale key}``).

    Raises:
        ModelLoadError: see :func:`identify`; a GGUF of another architecture or of a type not
            loaded (:func:`~.quantized.gguf_file.check_transformer`). The message names the file.
    """
    part, scales = transformer_keys(header), {}
    if gguf is not None:
        gguf_file.check_transformer(gguf, part)
    elif scaled_fp8.is_scaled_fp8(part):
        part, scales = scaled_fp8.split_scales(part)
    try:
        return identify({k: header[full][1] for k, full in part.items()}, family_name), part, scales
    except ModelLoadError as exc:
        raise ModelLoadError(f"model file {str(path)!r}: {exc}") from exc


def _open(path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], gguf_file.GGUFFile | None]:
    """The header of the file at ``path``, and the opened GGUF file when it is one."""
    if not gguf_file.is_gguf(path):
        return read_header(path), None
    try:
        opened = gguf_file.open_gguf(path)
    except DamagedFileError as exc:
        raise ModelLoadError(str(exc)) from exc
    return opened.header(), opened


def quantized_weight_bytes(path: str | Path, family_name: str | None = None) -> dict[str, int]:
    """``{diffusers key: bytes}`` of the quantized tensors of a GGUF file's transformer, as the
    model holds them after the layout conversion (run on ``meta`` tensors: nothing is read);
    empty for a safetensors file (its weights are held in the run's storage dtype).

    Raises:
        ModelLoadError: see :func:`identify_file`.
    """
    header, gguf = _open(path)
    if gguf is None:
        return {}
    found, part, _ = _identify_part(path, header, family_name, gguf)
    meta = {}
    for key, full in part.items():
        info, raw = gguf.tensors[full], gguf.reader.tensors[gguf.tensors[full].index]
        meta[key] = (torch.empty(info.shape, device="meta") if info.type_name in gguf_file.PLAIN or info.reshaped
                     else GGUFWeight(torch.empty(tuple(raw.data.shape), dtype=torch.uint8, device="meta"),
                                     quant_type=raw.tensor_type))
    if found.layout == "original":
        meta = _converter(next(f for f in FORMATS if f.family == found.family.name), found.family, found.config)(meta)
    return {k: v.numel() for k, v in meta.items() if is_gguf_weight(v)}


def load_transformer_file(path: str | Path, family_name: str | None = None, dtype: torch.dtype = torch.float32,
                          log: Callable[[str], None] = print) -> tuple[torch.nn.Module, Identified]:
    """The transformer in the ``.safetensors`` or GGUF file at ``path``, in ``dtype``, eval mode.

    Each floating tensor is cast to ``dtype`` as it is read, before the conversion (so for an
    fp16 base, modules a class keeps in fp32 carry fp16 rounding; training brings them back to
    fp32), and integer tensors keep theirs. A scaled fp8 weight is dequantized to ``dtype`` as it
    is read (:mod:`.quantized.scaled_fp8`). A GGUF file's quantized Linear weights stay quantized
    (their layers become :class:`~.quantized.gguf_linear.GGUFLinear`, dequantizing to ``dtype``
    per call); its other tensors are read like a safetensors file's. The model is built without
    initialising weights (``accelerate.init_empty_weights``, as diffusers' loaders do) and its
    parameters are the file's tensors (assigned); buffers are cast as ``from_pretrained`` casts
    them. One line goes to ``log``: the family, layout, variant, dtypes and quantized layers.

    Raises:
        ModelLoadError: see :func:`identify_file`; a conversion that cannot run on a GGUF file's
            quantized tensors, or weights that do not fit the model (the key named).
    """
    header, gguf = _open(path)
    found, part, scales = _identify_part(path, header, family_name, gguf)
    if gguf is not None:
        tensors = {key: gguf_file.read_tensor(gguf, full, dtype) for key, full in part.items()}
        stored = (f"GGUF {'/'.join(sorted({header[full][0] for full in part.values()}))} "
                  f"(general.architecture {gguf.architecture})")
    else:
        tensors = _read_safetensors(path, part, scales, dtype)
        stored = "/".join(sorted(_dtype_counts(header, part.values()))) or "no floats"
        stored += f", scaled fp8 ({len(scales)} layers, dequantized as read)" if scales else ""
    if found.layout == "original":
        fmt = next(f for f in FORMATS if f.family == found.family.name)
        try:
            tensors = _converter(fmt, found.family, found.config)(tensors)
        except (KeyError, IndexError, RuntimeError, ValueError) as exc:  # on the real tensors: GGUF blocks
            raise ModelLoadError(f"model file {str(path)!r}: the {found.family.name} conversion to the diffusers "
                                 f"layout cannot run on its tensors: {type(exc).__name__}: {exc}") from exc
    with init_empty_weights():
        model = found.family.model_cls().from_config(found.config)
    try:
        kept = assign_weights(model, tensors, dtype, keeps_fp32(model))
    except RuntimeError as exc:
        raise ModelLoadError(f"model file {str(path)!r}: its {found.describe()} weights do not fit the model "
                             f"({exc})") from exc
    if not (dtype == torch.float16 and model._keep_in_fp32_modules):
        model.to(dtype)
    quantized = f"; {kept} Linear layers kept quantized (dequantized per layer)" if gguf is not None else ""
    log(f"model file {path}: {found.describe()}; stored as {stored}, loaded as {str(dtype).removeprefix('torch.')}"
        f"{quantized}")
    return model.eval(), found


def _read_safetensors(path, part: dict[str, str], scales: dict[str, str], dtype: torch.dtype) -> dict:
    """``{key: tensor}`` of ``part`` read from a safetensors file one tensor at a time: floats cast to
    ``dtype``, scaled fp8 weights (``scales``: ``{weight key: scale key}``) dequantized to it."""
    tensors = {}
    with safe_open(str(path), framework="pt") as fh:
        for key, full in part.items():
            tensor = fh.get_tensor(full)
            if key in scales:
                tensor = scaled_fp8.dequantize_fp8(tensor, fh.get_tensor(scales[key]), dtype)
            tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return tensors


def load_model_file(path: str | Path, family_name: str | None = None, vae_path: str | Path | None = None,
                    text_encoder_path: str | Path | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32, log: Callable[[str], None] = print) -> ModelBundle:
    """A :class:`~.loading.ModelBundle` of the transformer in one ``.safetensors`` or GGUF file (never the
    network), with the VAE of ``vae_path`` (a diffusers folder; ``None``: no VAE, so image data
    cannot be encoded) and the text encoder of ``text_encoder_path`` (default: the deterministic
    embedder).

    Raises:
        ModelLoadError: see :func:`load_transformer_file`; a VAE folder that cannot be loaded.
    """
    transformer, found = load_transformer_file(path, family_name, dtype, log)
    if isinstance(text_encoder_path, (str, Path)):
        text_encoder_path = [text_encoder_path]
    return assemble_bundle(found.family, transformer, str(path), Path(vae_path) if vae_path else None,
                           [Path(p) for p in text_encoder_path or []], seed)
