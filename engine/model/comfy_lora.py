"""LoRA files in ComfyUI's names: the released layout of each family, fused projections as one LoRA.

ComfyUI 0.3.64 (``comfy/lora.py`` ``model_lora_keys_unet``) maps a LoRA key ``diffusion_model.<key>``
(and kohya's ``lora_unet_<key with _>``) to its model's weight ``<key>.weight``, in the layout the
family was released in (:mod:`.layouts`); ``comfy/weight_adapter/lora.py`` reads ``<name>.lora_up.weight``
and ``<name>.lora_down.weight`` and, without an ``<name>.alpha`` tensor, applies scale 1. So a file
here holds, per original weight ``W`` (``out x in``), ``lora_down`` = A and ``lora_up`` = B with the
trained scale already in B (as :mod:`.lora_files` folds it), and ``W + B @ A`` is what the trained
adapter added.

Where the released layout fuses several diffusers weights into one (``qkv``: q, k and v; Flux's
``single_blocks.N.linear1``: q, k, v and the MLP input), the parts' LoRAs ``B_i @ A_i`` become one
LoRA of rank ``sum r_i``: A is the parts' A stacked (``[A_q; A_k; A_v]``), B is block-diagonal (part
i's B in its rows of the fused weight and its columns of A; zero elsewhere). Then
``B @ A = [B_q A_q; B_k A_k; B_v A_v]``, exactly the fused weight's update; rows of parts without a
LoRA are zero. :func:`from_comfy_keys` splits such a file back exactly.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .distributed import plain_name
from .layouts import OriginalLayout, row_map

UP, DOWN = ".lora_up.weight", ".lora_down.weight"
A, B = ".lora_A.weight", ".lora_B.weight"


def base_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the base model's state dict in the diffusers layout, without the adapter
    (peft's ``base_layer`` folded back into the module's name, its ``lora_*`` tensors left out)."""
    shapes = {}
    for key, value in model.state_dict(keep_vars=True).items():
        key = plain_name(key)
        if ".lora_" in key:
            continue
        shapes[key.replace(".base_layer.", ".")] = tuple(value.shape)
    return shapes


def comfy_name(layout: OriginalLayout, weight_key: str) -> str:
    """The LoRA name ComfyUI maps to the original weight ``weight_key`` (``double_blocks.0.img_attn.qkv.weight``
    -> ``diffusion_model.double_blocks.0.img_attn.qkv``; UNet: ``lora_unet_input_blocks_1_1_proj_in``)."""
    module = weight_key.removesuffix(".weight")
    if layout.lora_prefix == "lora_unet_":
        return "lora_unet_" + module.replace(".", "_")
    return layout.lora_prefix + module


def _modules(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(A)] for k in tensors if k.endswith(A))


def to_comfy_keys(tensors: Mapping[str, torch.Tensor], layout: OriginalLayout,
                  shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Bare adapter tensors (``<module>.lora_A.weight`` (r, in, ...), ``<module>.lora_B.weight``
    (out, r, ...), the scale folded into B) -> ComfyUI's keys (see the module docstring).

    Args:
        tensors: diffusers module names, no prefix.
        layout: the family's released layout.
        shapes: the base model's ``{key: shape}`` (:func:`base_shapes`).

    Raises:
        LayoutError: a module's weight has no place in the released layout.
    """
    modules = _modules(tensors)
    rows = row_map(layout, shapes, [m + ".weight" for m in modules])
    groups: dict[str, list[str]] = {}
    for module in modules:
        groups.setdefault(rows[module + ".weight"].key, []).append(module)
    out = {}
    for okey, parts in groups.items():
        parts.sort(key=lambda m: int(rows[m + ".weight"].rows.min()))
        downs = [tensors[m + A] for m in parts]
        ups = [tensors[m + B] for m in parts]
        total, rank = rows[parts[0] + ".weight"].total, sum(d.shape[0] for d in downs)
        up = ups[0].new_zeros((total, rank) + tuple(ups[0].shape[2:]))
        col = 0
        for m, u in zip(parts, ups):
            up[rows[m + ".weight"].rows, col:col + u.shape[1]] = u
            col += u.shape[1]
        name = comfy_name(layout, okey)
        out[name + DOWN] = torch.cat(downs, dim=0).contiguous()
        out[name + UP] = up.contiguous()
    return out


def from_comfy_keys(tensors: Mapping[str, torch.Tensor], layout: OriginalLayout,
                    shapes: Mapping[str, tuple[int, ...]], modules: list[str]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_comfy_keys` for an adapter on ``modules`` (diffusers names): each
    fused LoRA split into its parts' A (equal row blocks of ``lora_down``, in row order) and B
    (their rows and columns of ``lora_up``).

    Raises:
        LayoutError: a module's weight has no place in the released layout.
        ValueError: a name the adapter has no module for, a LoRA missing, or a fused LoRA whose B
            is not block-diagonal (not one this pack wrote: its split would not be exact).
    """
    rows = row_map(layout, shapes, [m + ".weight" for m in modules])
    groups: dict[str, list[str]] = {}
    for module in modules:
        groups.setdefault(comfy_name(layout, rows[module + ".weight"].key), []).append(module)
    unknown = sorted({k.removesuffix(UP).removesuffix(DOWN) for k in tensors} - set(groups))
    if unknown:
        raise ValueError(f"LoRA names this run's adapter has no module for: {', '.join(unknown[:3])}")
    out = {}
    for name, parts in groups.items():
        if name + DOWN not in tensors or name + UP not in tensors:
            raise ValueError(f"no {name}{DOWN} / {UP} in the file")
        parts.sort(key=lambda m: int(rows[m + ".weight"].rows.min()))
        down, up = tensors[name + DOWN], tensors[name + UP]
        rank = down.shape[0] // len(parts)
        kept = torch.zeros_like(up, dtype=torch.bool)
        for i, m in enumerate(parts):
            r = rows[m + ".weight"].rows
            out[m + A] = down[i * rank:(i + 1) * rank].clone()
            out[m + B] = up[r, i * rank:(i + 1) * rank].clone()
            kept[r, i * rank:(i + 1) * rank] = True
        if bool(up[~kept].ne(0).any()):
            raise ValueError(f"{name}: lora_up is not block-diagonal over {', '.join(parts)}: it cannot be split exactly")
    return out
