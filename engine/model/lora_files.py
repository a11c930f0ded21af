"""LoRA: configuration, injection through peft, and the ``.safetensors`` file format.

Files are written in the diffusers key format with the ``transformer.`` prefix
(``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``), which both diffusers'
``load_lora_weights`` and ComfyUI's own LoRA loader map (docs/SCHEDULES.md "LoRA files": bare
peft keys load zero keys in ComfyUI 0.3.64). Keys never carry the peft adapter name.

The scale is folded into the weights: each module's ``lora_B`` is stored multiplied by peft's
scaling (``alpha / rank``), no ``.alpha`` tensor is written, and the header's
``lora_adapter_metadata`` (diffusers' own entry) says ``lora_alpha = r``. Every reader then
applies scale 1 to the same product ``B @ A``:

- ComfyUI (``comfy/lora.py`` ``load_lora``, ``comfy/weight_adapter/lora.py``
  ``LoRAAdapter.calculate_weight``) uses ``<key>.alpha / rank`` when that tensor exists, else 1;
  it does not read the header.
- diffusers 0.42 builds the ``LoraConfig`` from ``lora_adapter_metadata`` when present
  (``loaders/peft.py`` ``load_lora_adapter`` -> ``utils/peft_utils.py`` ``_create_lora_config``).
  Its SD3, Wan, Sana, Qwen-Image, Lumina2, ... loaders refuse ``.alpha`` keys ("Invalid LoRA
  checkpoint": every key must contain ``lora``), and Flux's refuses ``.alpha`` keys together
  with metadata ("Both `network_alphas` and `metadata` cannot be specified"), so a file with
  ``.alpha`` tensors cannot load everywhere.

The trained settings (rank, alpha, targets, dropout) stay in the header as ``lora_settings``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from ..config.lora import LoraConfigError, LoraSettings
from ..files.checks import check_safetensors
from ..files.tensors import atomic_save_file
from .comfy_lora import base_shapes, from_comfy_keys, to_comfy_keys
from .distributed import full_tensor, plain_name
from .layouts import LayoutError, get_layout
from .precision import quiet_torchao

PREFIX = "transformer."
"""Key prefix of the files: diffusers' ``transformer_name``, which ComfyUI maps too."""
ADAPTER = "default"
"""The peft adapter name :func:`add_lora` creates (never written to the file)."""
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
"""Header entry diffusers reads the ``LoraConfig`` from (``diffusers.loaders.lora_base``)."""


def add_lora(model: torch.nn.Module, settings: LoraSettings, default_targets: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """Freeze ``model`` and inject a LoRA adapter with peft; return the trainable parameters.

    The adapter's weights are fp32 whatever the base's dtype (bf16, fp16, quantized): peft
    creates them in the base layer's dtype, and bf16 LoRA updates lose small steps.

    Raises:
        LoraConfigError: no module of ``model`` matches the target names.
    """
    targets = list(settings.target_modules or default_targets)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, init_lora_weights=settings.init)
    model.requires_grad_(False)
    try:
        with quiet_torchao():  # peft imports torchao (when installed) to recognise quantized layers
            if isinstance(model, PeftAdapterMixin):
                model.add_adapter(config)
            else:  # diffusers classes without PeftAdapterMixin (PixArt, OmniGen, DiT, ...)
                inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise LoraConfigError(f"lora_target_modules={targets!r} matched no module of "
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
    with rsLoRA), the factor peft multiplies ``lora_B(lora_A(x))`` by in the forward."""
    return {plain_name(name): float(module.scaling[ADAPTER]) for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.scaling}


def to_file_keys(state: Mapping[str, torch.Tensor],
                 scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Bare peft keys -> file keys: the ``transformer.`` prefix; each module's scale folded into its ``lora_B``.

    Args:
        state: from :func:`lora_state_dict` (``<module>.lora_A.weight``, ``<module>.lora_B.weight``).
        scales: from :func:`adapter_scales`.

    Raises:
        KeyError: a ``lora_B`` tensor of a module that ``scales`` does not list.
    """
    out = {}
    for key, value in state.items():
        module, sep, _ = key.partition(".lora_B.")
        if sep:
            if module not in scales:
                raise KeyError(f"LoRA key {key!r}: module {module!r} has no peft scaling in the model")
            value = value * scales[module]  # B' = scale * B, so that B' @ A = scale * (B @ A)
        out[PREFIX + key] = value
    return out


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
    config.update(lora_alpha=config["r"], alpha_pattern=dict(config["rank_pattern"]), use_rslora=False)
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps({PREFIX + k: v for k, v in config.items()}, indent=2, sort_keys=True)


@dataclass(frozen=True)
class LoraWeights:
    """A trained LoRA without its model: all that :func:`save_lora_files` writes, as CPU tensors.

    A finished run hands it on instead of the trained model copy (whose frozen base weights, runner
    and host buffers a long-lived ComfyUI server would otherwise keep in its node cache, issue 34).

    Attributes:
        state: :func:`lora_state_dict` of the model (bare peft keys; ``lora_A`` ``(r, in)``,
            ``lora_B`` ``(out, r)``), on the CPU.
        scales: :func:`adapter_scales` (``alpha / rank`` by module name).
        shapes: :func:`~.comfy_lora.base_shapes` (the base weights' shapes, for ComfyUI's fused keys).
        metadata: :func:`diffusers_metadata` (the ``lora_adapter_metadata`` header value).
    """

    state: dict[str, torch.Tensor]
    scales: dict[str, float]
    shapes: dict[str, tuple[int, ...]]
    metadata: str

    @classmethod
    def of(cls, source: torch.nn.Module | LoraWeights) -> LoraWeights:
        """The LoRA of a model with a peft adapter (from :func:`add_lora`); a :class:`LoraWeights` as it
        is. Of a sharded model this gathers (:func:`lora_state_dict`): every rank must call it."""
        if isinstance(source, LoraWeights):
            return source
        state = {k: v.cpu() for k, v in lora_state_dict(source).items()}
        return cls(state, adapter_scales(source), base_shapes(source), diffusers_metadata(source))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.state.values())


def save_lora(model: torch.nn.Module | LoraWeights, path: str | Path, settings: LoraSettings,
              metadata: Mapping[str, Any] | None = None, write: bool = True) -> Path:
    """Save the model's LoRA as a ComfyUI/diffusers-loadable ``.safetensors`` file (atomic).

    Both loaders change the base exactly as the trained adapter did (scale folded into ``lora_B``,
    see the module docstring); ``tests/model/test_lora_files.py`` checks it for every family (through
    diffusers where the family has a LoRA loader there).

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


def _from_comfy_file(model, path, tensors, family) -> dict[str, torch.Tensor]:
    """A ComfyUI-format file of this pack as ``transformer.``-prefixed bare keys (its scale is 1)."""
    layout = get_layout(family) if family else None
    if layout is None:
        raise LoraConfigError(f"init_lora={str(path)!r} is a ComfyUI-format LoRA; family {family!r} has no released "
                              "layout to read it back: give the diffusers file (lora_format diffusers or both)")
    modules = sorted(k[: -len(".lora_A.weight")] for k in lora_state_dict(model) if k.endswith(".lora_A.weight"))
    try:
        bare = from_comfy_keys(tensors, layout, base_shapes(model), modules)
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
    family's released-layout names (:func:`~.comfy_lora.to_comfy_keys`), its header the same
    ``metadata`` and ``lora_settings`` and ``lora_format = comfyui`` (no ``lora_adapter_metadata``:
    its keys are not diffusers'). Each file is written atomically, the diffusers one first.

    Raises:
        OutputWriteError: a file could not be written.
        LayoutError: an adapted module has no place in the released layout.
    """
    paths = lora_paths(path, lora_format, family, primary)
    weights = LoraWeights.of(model)  # gathered once (a collective of a sharded model)
    if "diffusers" in paths:
        save_lora(weights, paths["diffusers"], settings, {**(metadata or {}), "family": family}, write)
    if "comfyui" in paths:
        scales = weights.scales
        bare = {k: v * scales[k.partition(".lora_B.")[0]] if ".lora_B." in k else v
                for k, v in weights.state.items()}
        tensors = to_comfy_keys(bare, get_layout(family), weights.shapes)
        if write:
            header = {k: v if isinstance(v, str) else json.dumps(v)
                      for k, v in {**(metadata or {}), "family": family}.items()}
            header.update({"format": "pt", "lora_format": "comfyui", "lora_settings": json.dumps(asdict(settings))})
            atomic_save_file(tensors, paths["comfyui"], header)
    return paths


def load_lora_file(model: torch.nn.Module, path: str | Path, settings: LoraSettings, family: str | None = None) -> int:
    """Start the model's adapter from a LoRA file: one this pack saved (either ``lora_format``), or
    a diffusers/kohya-style file with ``transformer.`` keys (``.alpha`` tensors or
    ``lora_adapter_metadata`` give its scale). A ComfyUI-format file of this pack (header
    ``lora_format = comfyui``) is split back into the adapter's modules exactly
    (:func:`~.comfy_lora.from_comfy_keys`; needs ``family``).

    The file's effective update ``file_scale * B @ A`` is kept exactly: ``B`` is loaded as
    ``B_file * file_scale / run_scale`` (``run_scale`` = the run's alpha / rank).

    Returns:
        The number of adapted modules loaded.

    Raises:
        DamagedFileError: the file is missing or damaged.
        LoraConfigError: its rank differs from the run's, or its modules differ from the adapter's.
    """
    header = check_safetensors(path, "init_lora", "give another LoRA file or none")
    tensors = load_file(str(path))
    metadata = json.loads(header.get(LORA_ADAPTER_METADATA_KEY, "{}") or "{}")
    if header.get("lora_format") == "comfyui":
        tensors = _from_comfy_file(model, path, tensors, family)
    meta_scale = (metadata.get(PREFIX + "lora_alpha", 1.0) / metadata.get(PREFIX + "r", 1.0)
                  if PREFIX + "r" in metadata else 1.0)
    scales = adapter_scales(model)
    state = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX) or key.endswith(".alpha"):
            continue
        bare = key[len(PREFIX):]
        module, sep, _ = bare.partition(".lora_B.")
        if sep:
            down = tensors.get(f"{PREFIX}{module}.lora_A.weight")
            alpha = tensors.get(f"{PREFIX}{module}.alpha")
            file_scale = float(alpha) / down.shape[0] if alpha is not None and down is not None else meta_scale
            if module not in scales:
                raise LoraConfigError(f"init_lora={str(path)!r}: module {module!r} is not adapted in this run "
                                      f"(lora_target_modules={list(settings.target_modules or [])!r})")
            value = value * (file_scale / scales[module])
        elif bare.endswith(".lora_A.weight") and value.shape[0] != settings.rank:
            raise LoraConfigError(f"init_lora={str(path)!r} has rank {value.shape[0]} ({bare}); "
                                  f"allowed lora_rank={settings.rank}, the run's: set lora_rank to {value.shape[0]}")
        state[bare] = value
    if not state:
        raise LoraConfigError(f"init_lora={str(path)!r} holds no 'transformer.'-prefixed lora_A/lora_B weights")
    expected = set(lora_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise LoraConfigError(f"init_lora={str(path)!r} does not match this run's adapter: missing {missing}, "
                              f"unexpected {extra}")
    load_lora_state_dict(model, state)
    return len(state) // 2
