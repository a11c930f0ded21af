"""The run's adapter, through peft: LoRA (and DoRA), LoKr and LoHa; which modules it adapts, how it
is built, what its tensors are called and which of them carries the scale.

peft names an adapter's tensors ``<module>.<tensor>`` in its state dict
(``get_peft_model_state_dict``, the adapter name left out): LoRA ``lora_A.weight`` ``(r, in)``,
``lora_B.weight`` ``(out, r)`` and, with DoRA, ``lora_magnitude_vector`` ``(out,)``; LoKr
``lokr_w1`` or ``lokr_w1_a`` / ``lokr_w1_b`` and ``lokr_w2`` or ``lokr_w2_a`` / ``lokr_w2_b``
(``peft/tuners/lokr/layer.py``: the update is ``scale * kron(w1, w2)``); LoHa ``hada_w1_a``
``(out, r)``, ``hada_w1_b`` ``(r, in)``, ``hada_w2_a``, ``hada_w2_b`` (``peft/tuners/loha/layer.py``:
``scale * (w1_a @ w1_b) * (w2_a @ w2_b)``). Each update is linear in one tensor (:attr:`~.lora_header.AdapterKind.scaled`),
so multiplying that tensor by peft's scaling (``alpha / r``) gives the same update at scale 1: what
the files hold (``engine/model/lora_files.py``), so that every reader applies scale 1.

The names are declared in :mod:`.lora_header` (:data:`~.lora_header.KINDS`, read before any heavy
import); here: :func:`peft_config`, :func:`target_modules`, :func:`adapter_layers`,
:func:`fold_scales`, :func:`dora_norms`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.lycoris_utils import LycorisLayer
from peft.utils.integrations import dequantize_module_weight

from ..config.lora import LoraConfigError, LoraSettings
from ..families import FamilyAdapter
from .distributed import full_tensor, plain_name
from .lora_header import MAGNITUDE, split_key

_WEIGHTED = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""Layers whose weights have output rows (DoRA's norms)."""

ADAPTER = "default"
"""The peft adapter name :func:`~.lora_files.add_lora` creates (never written to a file)."""


FULL_RANK = 2**16
"""The rank and alpha a full-matrix LoKr is built with: peft keeps ``w1`` whole unless ``decompose_both``
and ``w2`` whole when ``r >= max(w2's shape) / 2`` (``peft/tuners/lokr/layer.py`` ``update_layer``), so no
layer narrower than 131072 gets a low-rank factor, and the scale ``alpha / r`` is 1, as LyCORIS scales
full matrices (its ``full_matrix``) and ComfyUI applies a LoKr file without low-rank factors."""


def peft_config(settings: LoraSettings, targets: list[str]) -> PeftConfig:
    """The peft config of ``settings`` adapting the modules ``targets`` (peft's matching: a name
    equal to a target or ending in ``.<target>``)."""
    if settings.lora_type == "lokr":
        rank, alpha = (FULL_RANK, FULL_RANK) if settings.full_matrix else (settings.rank, settings.alpha)
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, init_weights=bool(settings.init),
                          decompose_factor=settings.factor)
    if settings.lora_type == "loha":
        return LoHaConfig(r=settings.rank, alpha=settings.alpha, target_modules=targets,
                          init_weights=bool(settings.init))
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, init_lora_weights=settings.init, use_dora=settings.use_dora)


def target_modules(model: torch.nn.Module, settings: LoraSettings, default_targets: tuple[str, ...],
                   family: FamilyAdapter | None = None) -> list[str]:
    """The ``target_modules`` given to peft: the settings' names, the family's attention
    projections (``default_targets``, the ``attention`` preset), or for ``all-linear`` the full name
    of every ``nn.Linear`` inside ``family``'s block lists (its embedders, final norm and output
    projection, outside the blocks, stay frozen), read from ``model``.

    Raises:
        LoraConfigError: ``all-linear`` without a family, or a model with no Linear in its blocks.
    """
    names = settings.target_modules
    if names != ("all-linear",):
        return list(names or default_targets)
    if family is None:
        raise LoraConfigError("lora_target_modules='all-linear' is invalid here: allowed module names (the "
                              "family's block lists are not known to this caller)")
    where = {id(m): n for n, m in model.named_modules()}
    found: dict[str, None] = {}
    for block_list in family.block_lists:
        for block in family.blocks(model, block_list):
            for module in block.modules():
                if isinstance(module, torch.nn.Linear) and id(module) in where:
                    found[where[id(module)]] = None
    if not found:
        raise LoraConfigError(f"lora_target_modules='all-linear' is invalid for {type(model).__name__}: its block "
                              "lists hold no Linear layer; allowed module names")
    return list(found)


def adapter_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's layers of the run's adapter, by module name (names as in the unsharded model)."""
    return {plain_name(name): module for name, module in model.named_modules()
            if isinstance(module, (LoraLayer, LycorisLayer)) and ADAPTER in module.scaling}


def fold_scales(state: Mapping[str, torch.Tensor], scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """``state`` (bare adapter keys) with each module's :attr:`~.lora_header.AdapterKind.scaled` tensor multiplied by
    ``scales[module]``: the update of every module multiplied by its scale.

    Raises:
        KeyError: a module that ``scales`` does not list.
    """
    chosen: dict[str, str] = {}
    for key in state:
        found = split_key(key)
        if found is not None and found[1] in found[2].scaled:
            module, tensor, kind = found
            if module not in chosen or kind.scaled.index(tensor) < kind.scaled.index(chosen[module]):
                chosen[module] = tensor
    out = dict(state)
    for module, tensor in chosen.items():
        if module not in scales:
            raise KeyError(f"adapter tensor {module}.{tensor}: module {module!r} has no peft scaling in the model")
        out[f"{module}.{tensor}"] = state[f"{module}.{tensor}"] * scales[module]
    return out


def _base_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The frozen weight under a peft layer, whole (gathered under FSDP), dequantized, fp32, on the CPU."""
    return full_tensor(dequantize_module_weight(layer.get_base_layer())).detach().float().cpu()


def lora_delta(down: torch.Tensor, up: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``up @ down`` reshaped to the weight's ``shape`` (a conv's kernels flattened, as peft and
    ComfyUI's ``weight_adapter/lora.py`` do): ``down`` ``(r, in, ...)``, ``up`` ``(out, r, ...)``."""
    return (up.flatten(1).float() @ down.flatten(1).float()).reshape(shape)


def dora_norms(model: torch.nn.Module, state: Mapping[str, torch.Tensor],
               scales: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Row norms a ComfyUI DoRA file needs (``engine/model/comfy_lora.py``): ``<module>.weight`` ->
    ``||W||`` per output row ``(out,)`` for every Linear and conv weight of the base, and
    ``<module>.merged`` -> ``||W + scale * B @ A||`` per row for each DoRA module (the norm peft
    divides the magnitude by, ``peft/tuners/lora/dora.py`` ``get_weight_norm``). fp32, CPU; empty
    without DoRA. Gathers the weights of a sharded model: every rank must call it.
    """
    layers = adapter_layers(model)
    if not any(k.endswith("." + MAGNITUDE) for k in state):
        return {}
    norms: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        name = plain_name(name)
        if (isinstance(module, (LoraLayer, LycorisLayer)) or not isinstance(module, _WEIGHTED)
                or ".lora_" in name or name.endswith(".base_layer")):  # peft's layers and their parts: below
            continue
        norms[name + ".weight"] = full_tensor(dequantize_module_weight(module)).detach().float().cpu() \
            .flatten(1).norm(dim=1)
    for name, layer in layers.items():
        weight = _base_weight(layer)
        norms[name + ".weight"] = weight.flatten(1).norm(dim=1)
        if f"{name}.{MAGNITUDE}" in state:
            delta = lora_delta(state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"], weight.shape)
            norms[name + ".merged"] = (weight + scales[name] * delta).flatten(1).norm(dim=1)
    return norms
