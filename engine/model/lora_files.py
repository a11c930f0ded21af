"""LoRA, DoRA, LoKr and LoHa: injection through peft, and the ``.safetensors`` file formats.

Files are written in peft's key format with the ``transformer.`` prefix
(``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``; ``...to_q.lokr_w1``, ``...to_q.hada_w1_a``,
``...to_q.lora_magnitude_vector``: :mod:`.adapters`), which diffusers' ``load_lora_adapter`` and ComfyUI's
LoRA loader map (docs/SCHEDULES.md "LoRA files": bare peft keys load zero keys in ComfyUI 0.3.64).
Keys never carry the peft adapter name.

The scale is folded into the weights: one tensor of each module (``lora_B``, LoKr's ``w1``, LoHa's
``w1_a``) is stored multiplied by peft's scaling (``alpha / rank``), no ``.alpha`` tensor is
written, and the header's ``lora_adapter_metadata`` (diffusers' own entry) says alpha = r. Every
reader then applies scale 1 to the same update:

- ComfyUI (``comfy/lora.py`` ``load_lora``, ``comfy/weight_adapter/{lora,lokr,loha}.py``
  ``calculate_weight``) uses ``<key>.alpha / rank`` when that tensor exists, else 1; it does not
  read the header.
- diffusers 0.42 builds the ``LoraConfig`` (or ``LoKrConfig``) from ``lora_adapter_metadata`` when
  present (``loaders/peft.py`` ``load_lora_adapter`` -> ``utils/peft_utils.py``
  ``_create_lora_config`` / ``_create_lokr_config``). Its SD3, Wan, Sana, Qwen-Image, Lumina2, ...
  loaders refuse ``.alpha`` keys ("Invalid LoRA checkpoint": every key must contain ``lora``), and
  Flux's refuses ``.alpha`` keys together with metadata ("Both `network_alphas` and `metadata`
  cannot be specified"), so a file with ``.alpha`` tensors cannot load everywhere. The same rule
  keeps LoKr files out of every pipeline's ``load_lora_weights`` but Z-Image's and Flux.2's (their
  key check admits ``lokr``); the transformer's own ``load_lora_adapter`` reads them for every
  family. diffusers has no LoHa loader: a LoHa file is read by peft (``set_peft_model_state_dict``
  after ``LoHaConfig(**metadata)``), by ``init_lora`` here and by ComfyUI where it maps the
  family's diffusers names.

The trained settings (rank, alpha, targets, dropout, type) stay in the header as ``lora_settings``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from peft import inject_adapter_in_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from ..config.lora import LoraConfigError, LoraSettings
from ..families import FamilyAdapter
from ..files.checks import check_safetensors
from ..files.tensors import atomic_save_file
from .adapters import ADAPTER, adapter_layers, dora_norms, fold_scales, peft_config, target_modules
from .comfy_lora import DIFFUSERS_PREFIX, base_shapes, from_comfy_keys, to_comfy_keys
from .distributed import full_tensor, plain_name
from .layouts import LayoutError, get_layout
from .lora_header import KINDS, MAGNITUDE, kind_of, modules_of, split_key
from .precision import quiet_torchao

PREFIX = "transformer."
"""Key prefix of the files: diffusers' ``transformer_name``, which ComfyUI maps too."""
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
"""Header entry diffusers reads the ``LoraConfig`` from (``diffusers.loaders.lora_base``)."""


def add_lora(model: torch.nn.Module, settings: LoraSettings, default_targets: tuple[str, ...],
             family: FamilyAdapter | None = None) -> list[torch.nn.Parameter]:
    """Freeze ``model`` and inject the adapter of ``settings`` (LoRA, DoRA, LoKr or LoHa) with peft;
    return the trainable parameters.

    Args:
        default_targets: the family's attention projections (the ``attention`` preset).
        family: the model's family, whose block lists ``all-linear`` reads (:func:`~.adapters.target_modules`).

    The adapter's weights are fp32 whatever the base's dtype (bf16, fp16, quantized): peft
    creates them in the base layer's dtype, and bf16 updates lose small steps.

    Raises:
        LoraConfigError: no module of ``model`` matches the target names; ``all-linear`` without a family.
    """
    targets = target_modules(model, settings, default_targets, family)
    config = peft_config(settings, targets)
    model.requires_grad_(False)
    try:
        with quiet_torchao():  # peft imports torchao (when installed) to recognise quantized layers
            if isinstance(model, PeftAdapterMixin):
                model.add_adapter(config)
            else:  # diffusers classes without PeftAdapterMixin (PixArt, OmniGen, DiT, ...)
                inject_adapter_in_model(config, model)
    except ValueError as exc:
        shown = targets if len(targets) <= 8 else targets[:8] + [f"... ({len(targets)} in all)"]
        raise LoraConfigError(f"lora_target_modules={shown!r} matched no module of "
                              f"{type(model).__name__}: {exc}") from exc
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.dtype != torch.float32:
            p.data = p.data.float()
    return params


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's key format without the adapter name (no ``.default.``).

    Of a model sharded with FSDP (:mod:`.distributed`) the full tensors, named as in the unsharded
    model: gathering them is a collective, so every rank must call this.
    """
    # named like the modules peft matches them against (checkpoint_wrapper's state_dict hook would
    # strip its prefix from the keys but not from the module names)
    params = dict(model.named_parameters(remove_duplicate=False))
    return {plain_name(k): full_tensor(v).detach().clone().contiguous()
            for k, v in get_peft_model_state_dict(model, state_dict=params).items()}


def load_lora_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load weights from :func:`lora_state_dict` (bare keys) into the model's adapter.

    Raises:
        ValueError: keys missing from or unexpected for the model's adapter.
    """
    result = set_peft_model_state_dict(model, dict(state))
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"LoRA state has keys the model's adapter does not: {unexpected[:4]}")


def adapter_scales(model: torch.nn.Module) -> dict[str, float]:
    """peft's scaling of each adapted module, by module name: ``alpha / rank`` (``alpha / sqrt(rank)``
    with rsLoRA), the factor peft multiplies the module's update by in the forward."""
    return {name: float(layer.scaling[ADAPTER]) for name, layer in adapter_layers(model).items()}


def to_file_keys(state: Mapping[str, torch.Tensor],
                 scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Bare peft keys -> file keys: the ``transformer.`` prefix; each module's scale folded into its
    scaled tensor (:func:`~.adapters.fold_scales`: ``B' = scale * B``, so that ``B' @ A = scale * (B @ A)``).

    Args:
        state: from :func:`lora_state_dict`.
        scales: from :func:`adapter_scales`.

    Raises:
        KeyError: a module that ``scales`` does not list.
    """
    return {PREFIX + k: v for k, v in fold_scales(state, scales).items()}


def diffusers_metadata(model: torch.nn.Module) -> str:
    """The ``lora_adapter_metadata`` header value, in the format diffusers writes it.

    diffusers' ``save_lora_weights(..., transformer_lora_adapter_metadata=peft_config.to_dict())``
    (``LoraBaseMixin._save_lora_weights`` and ``write_lora_layers`` in ``loaders/lora_base.py``)
    writes the adapter's ``LoraConfig.to_dict()`` with every key prefixed by ``transformer.``, sets
    as lists, as ``json.dumps(..., indent=2, sort_keys=True)``; its loaders pass the un-prefixed dict
    to ``LoraConfig(**metadata)``. The file's ``lora_B`` already carries the scale
    (:func:`to_file_keys`), so the config says ``lora_alpha = r`` (per-module alphas = ranks,
    no rsLoRA): scale 1 everywhere.
    """
    config = model.peft_config[ADAPTER].to_dict()
    alpha = "lora_alpha" if "lora_alpha" in config else "alpha"  # LoraConfig's name, LoKr's and LoHa's
    config.update({alpha: config["r"], "alpha_pattern": dict(config["rank_pattern"])})
    if "use_rslora" in config:
        config["use_rslora"] = False
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps({PREFIX + k: v for k, v in config.items()}, indent=2, sort_keys=True)


@dataclass(frozen=True)
class LoraWeights:
    """A trained adapter without its model: all that :func:`save_lora_files` writes, as CPU tensors.

    A finished run hands it on instead of the trained model copy (whose frozen base weights, runner
    and host buffers a long-lived ComfyUI server would otherwise keep in its node cache, issue 34).

    Attributes:
        state: :func:`lora_state_dict` of the model (bare peft keys: LoRA ``lora_A`` ``(r, in)``,
            ``lora_B`` ``(out, r)``, DoRA's ``lora_magnitude_vector`` ``(out,)``, LoKr's ``lokr_*``,
            LoHa's ``hada_*``: :mod:`.adapters`), on the CPU.
        scales: :func:`adapter_scales` (``alpha / rank`` by module name).
        shapes: :func:`~.comfy_lora.base_shapes` (the base weights' shapes, for ComfyUI's fused keys).
        metadata: :func:`diffusers_metadata` (the ``lora_adapter_metadata`` header value).
        norms: a DoRA adapter's row norms (:func:`~.adapters.dora_norms`, for ComfyUI's ``dora_scale``);
            empty otherwise.
    """

    state: dict[str, torch.Tensor]
    scales: dict[str, float]
    shapes: dict[str, tuple[int, ...]]
    metadata: str
    norms: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, source: torch.nn.Module | LoraWeights) -> LoraWeights:
        """The adapter of a model with a peft adapter (from :func:`add_lora`); a :class:`LoraWeights` as it
        is. Of a sharded model this gathers (:func:`lora_state_dict`): every rank must call it."""
        if isinstance(source, LoraWeights):
            return source
        state = {k: v.cpu() for k, v in lora_state_dict(source).items()}
        scales = adapter_scales(source)
        return cls(state, scales, base_shapes(source), diffusers_metadata(source), dora_norms(source, state, scales))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.state.values(), *self.norms.values()))


def save_lora(model: torch.nn.Module | LoraWeights, path: str | Path, settings: LoraSettings,
              metadata: Mapping[str, Any] | None = None, write: bool = True) -> Path:
    """Save the model's LoRA as a ComfyUI/diffusers-loadable ``.safetensors`` file (atomic).

    Both loaders change the base exactly as the trained adapter did (scale folded into ``lora_B``,
    see the module docstring); ``tests/model/test_lora_files.py`` checks it for every family (through
    diffusers where the family has a LoRA loader there), and for DoRA, LoKr and LoHa.

    Args:
        model: a model with a peft adapter (from :func:`add_lora`), or its :class:`LoraWeights`.
        path: destination file.
        settings: the LoRA settings, recorded in the header as ``lora_settings``.
        metadata: more header fields (family, schedule, ...); values are JSON-encoded. They cannot
            replace ``format`` (``"pt"``, safetensors' framework tag, as diffusers writes it),
            ``lora_adapter_metadata`` or ``lora_settings``.
        write: False on the ranks of a sharded run other than 0: they take part in gathering
            the weights and write nothing.
    """
    weights = LoraWeights.of(model)
    tensors = to_file_keys(weights.state, weights.scales)
    if not write:
        return Path(path)
    header = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    header.update({"format": "pt", LORA_ADAPTER_METADATA_KEY: weights.metadata,
                   "lora_settings": json.dumps(asdict(settings))})
    return atomic_save_file(tensors, path, header)


def _from_comfy_file(model, path, tensors, family, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """A ComfyUI-format file of this pack as ``transformer.``-prefixed bare keys (its scale is 1)."""
    if any(k.startswith(DIFFUSERS_PREFIX) for k in tensors):  # a LoKr in diffusers names: peft's own keys
        return dict(tensors)
    layout = get_layout(family) if family else None
    if layout is None:
        raise LoraConfigError(f"init_lora={str(path)!r} is a ComfyUI-format LoRA; family {family!r} has no released "
                              "layout to read it back: give the diffusers file (lora_format diffusers or both)")
    try:
        bare = from_comfy_keys(tensors, layout, base_shapes(model), modules_of(lora_state_dict(model)),
                               settings.lora_type)
    except (LayoutError, ValueError) as exc:
        raise LoraConfigError(f"init_lora={str(path)!r} does not match this run's adapter: {exc}") from exc
    return {PREFIX + k: v for k, v in bare.items()}


def lora_paths(path: str | Path, lora_format: str, family: str, primary: str = "diffusers") -> dict[str, Path]:
    """``{format: file}`` a save writes for ``lora_format`` (``engine/config/outputs.py``
    ``LORA_FORMATS``): one format takes ``path``; with ``both``, ``primary`` takes it and the other
    is ``<stem>_<format>.safetensors`` beside it (``segckpt``: ``lora.safetensors`` and
    ``lora_comfyui.safetensors``). A family without a released layout (:mod:`.layouts`) writes the
    diffusers file only.

    Raises:
        ValueError: ``comfyui`` for a family without a released layout (the run's checks refuse it
            before any work: ``engine/train/checks.py``).
    """
    path = Path(path)
    if get_layout(family) is None:
        if lora_format == "comfyui":
            raise ValueError(f"lora_format='comfyui' is invalid for family {family!r}: its released layout is not "
                             "mapped here; allowed diffusers or both (the diffusers file alone)")
        return {"diffusers": path}
    if lora_format == "diffusers":
        return {"diffusers": path}
    if lora_format == "comfyui":
        return {"comfyui": path}
    other = "comfyui" if primary == "diffusers" else "diffusers"
    return {primary: path, other: path.with_name(f"{path.stem}_{other}{path.suffix}")}


def save_lora_files(model: torch.nn.Module | LoraWeights, path: str | Path, settings: LoraSettings, family: str,
                    lora_format: str = "both", metadata: Mapping[str, Any] | None = None,
                    write: bool = True, primary: str = "diffusers") -> dict[str, Path]:
    """Save the model's LoRA in the files of ``lora_format`` (:func:`lora_paths`); ``{format: file}``.

    The diffusers file is :func:`save_lora`'s; the ComfyUI file holds the same update in the
    family's released-layout names, or a LoKr on fused weights in the diffusers names ComfyUI maps
    (:func:`~.comfy_lora.to_comfy_keys`), its header the same ``metadata`` and ``lora_settings``,
    ``lora_format = comfyui`` and ``comfyui_names`` (``released`` or ``diffusers``; no
    ``lora_adapter_metadata``: its keys are not diffusers'). Each file is written atomically, the
    diffusers one first.

    Raises:
        OutputWriteError: a file could not be written.
        LayoutError: an adapted module has no place in the released layout; a LoKr ComfyUI cannot
            apply exactly (:func:`~.comfy_lora.comfy_naming`, refused before training by
            ``engine/train/checks.py``). Nothing is written then.
    """
    paths = lora_paths(path, lora_format, family, primary)
    weights = LoraWeights.of(model)  # gathered once (a collective of a sharded model)
    comfy = None
    if "comfyui" in paths:  # converted first: a refusal writes nothing
        comfy = to_comfy_keys(fold_scales(weights.state, weights.scales), get_layout(family), weights.shapes,
                              weights.norms)
    if "diffusers" in paths:
        save_lora(weights, paths["diffusers"], settings, {**(metadata or {}), "family": family}, write)
    if comfy is not None and write:
        header = {k: v if isinstance(v, str) else json.dumps(v)
                  for k, v in {**(metadata or {}), "family": family}.items()}
        names = "diffusers" if any(k.startswith(DIFFUSERS_PREFIX) for k in comfy) else "released"
        header.update({"format": "pt", "lora_format": "comfyui", "comfyui_names": names,
                       "lora_settings": json.dumps(asdict(settings))})
        atomic_save_file(comfy, paths["comfyui"], header)
    return paths


def _file_scale(tensors: Mapping[str, torch.Tensor], module: str, metadata: Mapping[str, Any]) -> float:
    """The scale a file applies to ``module``'s update: ``<module>.alpha`` over the rank as ComfyUI
    reads it (``comfy/weight_adapter/*.py``: the first rank tensor of :attr:`~.lora_header.AdapterKind.rank`;
    a LoKr of two full factors: 1), else the metadata's alpha / r, else 1."""
    alpha = tensors.get(f"{PREFIX}{module}.alpha")
    if alpha is not None:
        kind = kind_of(k for k in tensors if k.startswith(f"{PREFIX}{module}."))
        rank = next((tensors[f"{PREFIX}{module}.{t}"].shape[d] for t, d in kind.rank
                     if f"{PREFIX}{module}.{t}" in tensors), None) if kind is not None else None
        return float(alpha) / rank if rank else 1.0
    alpha = metadata.get(PREFIX + "lora_alpha", metadata.get(PREFIX + "alpha"))
    return float(alpha) / metadata[PREFIX + "r"] if alpha is not None and PREFIX + "r" in metadata else 1.0


def _check_kind(path, tensors: Mapping[str, torch.Tensor], settings: LoraSettings) -> None:
    """Refuse a file of another adapter type than the run's (or DoRA where the run has none, or the reverse)."""
    found = kind_of(tensors) or (KINDS["lora"] if any(k.endswith(".lora_up.weight") for k in tensors) else None)
    if found is not None and found.name != settings.lora_type:
        raise LoraConfigError(f"init_lora={str(path)!r} holds a {found.name} adapter; this run's lora_type is "
                              f"{settings.lora_type!r}: set lora_type to {found.name}")
    dora = any(k.endswith(("." + MAGNITUDE, ".dora_scale")) for k in tensors)
    if found is not None and dora != settings.use_dora:
        raise LoraConfigError(f"init_lora={str(path)!r} holds a {'DoRA' if dora else 'LoRA without DoRA'}; this run's "
                              f"use_dora is {settings.use_dora}: set use_dora to {dora}")


def load_lora_file(model: torch.nn.Module, path: str | Path, settings: LoraSettings, family: str | None = None) -> int:
    """Start the model's adapter from an adapter file: one this pack saved (either ``lora_format``), or
    a diffusers/kohya-style file with ``transformer.`` keys (``.alpha`` tensors or
    ``lora_adapter_metadata`` give its scale). A ComfyUI-format LoRA, LoHa or LoKr file of this pack
    (header ``lora_format = comfyui``) is split back into the adapter's modules exactly
    (:func:`~.comfy_lora.from_comfy_keys`; needs ``family``).

    The file's effective update is kept exactly: the scaled tensor (``B``, LoKr's ``w1``, LoHa's
    ``w1_a``) is loaded as ``file tensor * file_scale / run_scale`` (``run_scale`` = the run's alpha / rank).

    Returns:
        The number of adapted modules loaded.

    Raises:
        DamagedFileError: the file is missing or damaged.
        LoraConfigError: another adapter type, DoRA or not, another rank, or modules that differ
            from the adapter's.
    """
    header = check_safetensors(path, "init_lora", "give another LoRA file or none")
    tensors = load_file(str(path))
    metadata = json.loads(header.get(LORA_ADAPTER_METADATA_KEY, "{}") or "{}")
    _check_kind(path, tensors, settings)
    if header.get("lora_format") == "comfyui":
        tensors = _from_comfy_file(model, path, tensors, family, settings)
    scales = adapter_scales(model)
    state = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX) or key.endswith(".alpha"):
            continue
        bare = key[len(PREFIX):]
        found = split_key(bare)
        ranks = dict(found[2].rank) if found is not None else {}
        if found is not None and found[1] in ranks and value.shape[ranks[found[1]]] != settings.rank:
            rank = value.shape[ranks[found[1]]]
            raise LoraConfigError(f"init_lora={str(path)!r} has rank {rank} ({bare}); "
                                  f"allowed lora_rank={settings.rank}, the run's: set lora_rank to {rank}")
        state[bare] = value
    if not state:
        raise LoraConfigError(f"init_lora={str(path)!r} holds no 'transformer.'-prefixed adapter weights "
                              "(lora_A/lora_B, lokr_*, hada_*)")
    unknown = [m for m in modules_of(state) if m not in scales]
    if unknown:
        raise LoraConfigError(f"init_lora={str(path)!r}: module {unknown[0]!r} is not adapted in this run "
                              f"(lora_target_modules={list(settings.target_modules or [])!r})")
    state = fold_scales(state, {m: _file_scale(tensors, m, metadata) / scales[m] for m in modules_of(state)})
    expected = set(lora_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise LoraConfigError(f"init_lora={str(path)!r} does not match this run's adapter: missing {missing}, "
                              f"unexpected {extra}")
    load_lora_state_dict(model, state)
    return len(modules_of(state))
