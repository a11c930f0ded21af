"""Adapter files in ComfyUI's names: the released layout of each family, fused projections as one
exact adapter, for LoRA, DoRA, LoHa and LoKr.

ComfyUI 0.3.64 (``comfy/lora.py`` ``model_lora_keys_unet``) maps a LoRA key ``diffusion_model.<key>``
(and kohya's ``lora_unet_<key with _>``) to its model's weight ``<key>.weight``, in the layout the
family was released in (:mod:`.layouts`); ``load_lora`` reads ``<name>.alpha`` and
``<name>.dora_scale`` and hands ``<name>`` to each adapter of ``comfy/weight_adapter/``. Without an
``alpha`` tensor each of them applies scale 1, so a file here holds the trained scale folded into one
tensor of each adapter (:func:`~.adapters.fold_scales`) and no ``alpha``:

- LoRA (``weight_adapter/lora.py``): ``lora_up`` = B, ``lora_down`` = A; the weight gets ``up @ down``.
- LoHa (``loha.py``): ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b``; the weight gets
  ``(w1_a @ w1_b) * (w2_a @ w2_b)``.
- LoKr (``lokr.py``): ``lokr_w1`` (or ``lokr_w1_a`` / ``lokr_w1_b``), ``lokr_w2`` (or its factors);
  the weight gets ``kron(w1, w2)``.
- DoRA (``base.py`` ``weight_decompose``): with ``dora_scale`` of shape ``(out, 1, ...)`` ComfyUI
  sets ``W' = (W + up @ down) * dora_scale / (||W|| + eps)``, the row norm taken of the weight
  *before* the update (eps: fp32's, the dtype ComfyUI patches in); peft's DoRA trained
  ``W' = (W + up @ down) * m / ||W + up @ down||``. So ``dora_scale = m * (||W|| + eps) / ||W + up @ down||``
  per row gives peft's weight exactly (it depends on the base weights, as ``m`` does).

Where the released layout fuses several diffusers weights into one (``qkv``: q, k and v; Flux's
``single_blocks.N.linear1``: q, k, v and the MLP input), the parts' LoRAs ``B_i @ A_i`` become one
LoRA of rank ``sum r_i``: A is the parts' A stacked (``[A_q; A_k; A_v]``), B is block-diagonal (part
i's B in its rows of the fused weight and its columns of A; zero elsewhere). Then
``B @ A = [B_q A_q; B_k A_k; B_v A_v]``, exactly the fused weight's update; rows of parts without an
adapter are zero. LoHa's two products fuse the same way (their element-wise product keeps the
blocks), DoRA's ``dora_scale`` gets each part's rows (``||W|| + eps`` on the rows without an adapter:
factor 1). A Kronecker product cannot be split into row blocks in general, so LoKr is written in the
released layout only where each adapted weight is one released weight with its rows in order;
elsewhere in the diffusers names ComfyUI maps for the family (:func:`comfy_naming`).
:func:`from_comfy_keys` splits a LoRA or LoHa file back exactly.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..families.comfyui import DIFFUSERS_KEYS
from .distributed import plain_name
from .layouts import LayoutError, OriginalLayout, Rows, row_map
from .lora_header import MAGNITUDE, kind_of, modules_of

UP, DOWN = ".lora_up.weight", ".lora_down.weight"
A, B = ".lora_A.weight", ".lora_B.weight"
DORA = ".dora_scale"
EPS = torch.finfo(torch.float32).eps
"""ComfyUI's ``weight_decompose`` adds ``finfo(weight.dtype).eps`` to the norm; it patches in fp32
(``comfy/model_patcher.py`` ``patch_weight_to_device``)."""
DIFFUSERS_PREFIX = "transformer."
"""How ComfyUI 0.3.64 names a diffusers module of the families in ``DIFFUSERS_KEYS``."""

PAIRS = {
    "lora": ((B[1:], A[1:], UP, DOWN),),
    "loha": (("hada_w1_a", "hada_w1_b", ".hada_w1_a", ".hada_w1_b"),
             ("hada_w2_a", "hada_w2_b", ".hada_w2_a", ".hada_w2_b")),
}
"""Per kind, its ``(up, down)`` pairs: ``(peft up, peft down, ComfyUI up suffix, ComfyUI down suffix)``;
up ``(out, r, ...)``, down ``(r, in, ...)``."""


def base_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the base model's state dict in the diffusers layout, without the adapter
    (peft's ``base_layer`` folded back into the module's name, its adapter tensors left out)."""
    shapes = {}
    for key, value in model.state_dict(keep_vars=True).items():
        key = plain_name(key)
        if any(f".{p}_" in key for p in ("lora", "lokr", "hada")):
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


def _groups(layout: OriginalLayout, shapes: Mapping[str, tuple[int, ...]],
            modules: list[str]) -> tuple[dict[str, Rows], dict[str, list[str]]]:
    """``(rows of each module's weight, {original weight: its adapted modules in row order})``."""
    rows = row_map(layout, shapes, [m + ".weight" for m in modules])
    groups: dict[str, list[str]] = {}
    for module in modules:
        groups.setdefault(rows[module + ".weight"].key, []).append(module)
    for parts in groups.values():
        parts.sort(key=lambda m: int(rows[m + ".weight"].rows.min()))
    return rows, groups


def _in_order(rows: Mapping[str, Rows], groups: Mapping[str, list[str]], shapes) -> str | None:
    """The first module whose weight is not a whole released weight in its own row order (None: all are)."""
    for parts in groups.values():
        for m in parts:
            r = rows[m + ".weight"]
            if len(parts) > 1 or r.total != shapes[m + ".weight"][0] or not torch.equal(r.rows, torch.arange(r.total)):
                return m
    return None


def comfy_naming(layout: OriginalLayout, shapes: Mapping[str, tuple[int, ...]], modules: list[str],
                 lora_type: str) -> str:
    """How a ComfyUI file names an adapter of ``lora_type`` on ``modules``: ``released`` (the
    family's released layout) or ``diffusers`` (``transformer.<module>``, a LoKr on a fused or
    reordered weight of a family whose diffusers names ComfyUI 0.3.64 maps).

    Raises:
        LayoutError: a module has no place in the released layout; a LoKr on a fused or reordered
            weight of a family whose diffusers names ComfyUI does not map (named, with the formats
            that can hold it).
    """
    rows, groups = _groups(layout, shapes, modules)
    if lora_type != "lokr":
        return "released"
    odd = _in_order(rows, groups, shapes)
    if odd is None:
        return "released"
    if layout.family in DIFFUSERS_KEYS:
        return "diffusers"
    okey = rows[odd + ".weight"].key
    fused = groups[okey]
    what = (f"fuses {', '.join(fused)} into {okey}" if len(fused) > 1 else
            f"holds {odd} in {okey} {'with other rows' if rows[odd + '.weight'].total != shapes[odd + '.weight'][0] else 'in another row order'}")
    raise LayoutError(f"lora_type='lokr' cannot be written as a ComfyUI file for {layout.family}: its released layout "
                      f"{what}, and a Kronecker product does not split into row blocks (ComfyUI 0.3.64 maps no "
                      f"diffusers names for {layout.family}); allowed lora_format=diffusers (the peft file), or "
                      "lora_type lora or loha (exact in ComfyUI's names), or lora_target_modules without that weight")


def _fuse(parts: list[str], rows: Mapping[str, Rows], ups: list[torch.Tensor],
          downs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' ``(up, down)`` as one pair of the fused weight: up block-diagonal ``(total, sum r, ...)``,
    down stacked ``(sum r, in, ...)``."""
    total, rank = rows[parts[0] + ".weight"].total, sum(d.shape[0] for d in downs)
    up = ups[0].new_zeros((total, rank) + tuple(ups[0].shape[2:]))
    col = 0
    for m, u in zip(parts, ups):
        up[rows[m + ".weight"].rows, col:col + u.shape[1]] = u
        col += u.shape[1]
    return up.contiguous(), torch.cat(downs, dim=0).contiguous()


def _dora_scale(okey: str, parts: list[str], tensors: Mapping[str, torch.Tensor], rows: Mapping[str, Rows],
                others: Mapping[str, Rows], norms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``dora_scale`` ``(total, 1, ...)`` of the original weight ``okey`` (module docstring): per row of
    a DoRA part ``m * (||W|| + eps) / ||W + dW||``, per row of any other part ``||W|| + eps``.

    Raises:
        LayoutError: rows of ``okey`` whose base norm is unknown (not every row would keep its weight).
    """
    first = rows[parts[0] + ".weight"]
    scale = torch.full((first.total,), float("nan"))
    for key, where in others.items():
        if where.key == okey and key in norms:
            scale[where.rows] = norms[key] + EPS
    for m in parts:
        magnitude = tensors[f"{m}.{MAGNITUDE}"].float().flatten()
        scale[rows[m + ".weight"].rows] = magnitude * (norms[m + ".weight"] + EPS) / norms[m + ".merged"]
    if bool(scale.isnan().any()):
        raise LayoutError(f"{okey}: rows of weights with no known norm; a ComfyUI DoRA file cannot keep them")
    return scale.reshape((first.total,) + (1,) * (first.ndim - 1))


def to_comfy_keys(tensors: Mapping[str, torch.Tensor], layout: OriginalLayout, shapes: Mapping[str, tuple[int, ...]],
                  norms: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Bare adapter tensors (``<module>.<tensor>``, peft's names, the scale folded in) -> ComfyUI's keys
    (see the module docstring; :func:`comfy_naming` says which names).

    Args:
        tensors: diffusers module names, no prefix.
        layout: the family's released layout.
        shapes: the base model's ``{key: shape}`` (:func:`base_shapes`).
        norms: the row norms of a DoRA adapter (:func:`~.adapters.dora_norms`).

    Raises:
        LayoutError: a module's weight has no place in the released layout; see :func:`comfy_naming`.
    """
    kind, modules = kind_of(tensors), modules_of(tensors)
    if kind is None:
        return {}
    if comfy_naming(layout, shapes, modules, kind.name) == "diffusers":
        return {DIFFUSERS_PREFIX + k: v.contiguous() for k, v in tensors.items()}
    rows, groups = _groups(layout, shapes, modules)
    out = {}
    dora = any(k.endswith("." + MAGNITUDE) for k in tensors)
    others = row_map(layout, shapes, [k for k in norms or {} if k.endswith(".weight")], strict=False) if dora else {}
    for okey, parts in groups.items():
        name = comfy_name(layout, okey)
        if kind.name == "lokr":  # one module per weight, rows in order (comfy_naming)
            out.update({f"{name}.{k.rpartition('.')[2]}": v.contiguous() for k, v in tensors.items()
                        if k.rpartition(".")[0] == parts[0]})
            continue
        for up_t, down_t, up_k, down_k in PAIRS[kind.name]:
            out[name + up_k], out[name + down_k] = _fuse(parts, rows, [tensors[f"{m}.{up_t}"] for m in parts],
                                                         [tensors[f"{m}.{down_t}"] for m in parts])
        if dora:
            out[name + DORA] = _dora_scale(okey, parts, tensors, rows, others, norms or {})
    return out


def from_comfy_keys(tensors: Mapping[str, torch.Tensor], layout: OriginalLayout,
                    shapes: Mapping[str, tuple[int, ...]], modules: list[str],
                    lora_type: str = "lora") -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_comfy_keys` for an adapter of ``lora_type`` on ``modules`` (diffusers
    names): each fused LoRA or LoHa pair split into its parts' down (equal row blocks, in row order)
    and up (their rows and columns); a LoKr's tensors renamed.

    Raises:
        LayoutError: a module's weight has no place in the released layout.
        ValueError: a DoRA file; a name the adapter has no module for, a tensor missing, or a fused
            up that is not block-diagonal (not one this pack wrote: its split would not be exact).
    """
    if any(k.endswith(DORA) for k in tensors):
        raise ValueError("a ComfyUI-format DoRA file is not read back here (its dora_scale holds the base weights' "
                         "norms): give the diffusers file saved beside it")
    rows, groups = _groups(layout, shapes, modules)
    names = {comfy_name(layout, okey): parts for okey, parts in groups.items()}
    if lora_type == "lokr":  # one module per weight, its tensors renamed (comfy_naming)
        out = {f"{names[k.rpartition('.')[0]][0]}.{k.rpartition('.')[2]}": v for k, v in tensors.items()
               if k.rpartition(".")[0] in names}
        if len(out) != len(tensors):
            raise ValueError("LoKr names this run's adapter has no module for: "
                             f"{', '.join(sorted(k for k in tensors if k.rpartition('.')[0] not in names)[:3])}")
        return out
    pairs = PAIRS[lora_type]
    suffixes = tuple(s for pair in pairs for s in pair[2:])
    unknown = sorted({next((k.removesuffix(s) for s in suffixes if k.endswith(s)), k) for k in tensors} - set(names))
    if unknown:
        raise ValueError(f"adapter names this run's adapter has no module for: {', '.join(unknown[:3])}")
    out = {}
    for name, parts in names.items():
        for up_t, down_t, up_k, down_k in pairs:
            if name + down_k not in tensors or name + up_k not in tensors:
                raise ValueError(f"no {name}{down_k} / {up_k} in the file")
            down, up = tensors[name + down_k], tensors[name + up_k]
            rank = down.shape[0] // len(parts)
            kept = torch.zeros_like(up, dtype=torch.bool)
            for i, m in enumerate(parts):
                r = rows[m + ".weight"].rows
                out[f"{m}.{down_t}"] = down[i * rank:(i + 1) * rank].clone()
                out[f"{m}.{up_t}"] = up[r, i * rank:(i + 1) * rank].clone()
                kept[r, i * rank:(i + 1) * rank] = True
            if bool(up[~kept].ne(0).any()):
                raise ValueError(f"{name}: {up_k.strip('.')} is not block-diagonal over {', '.join(parts)}: it cannot "
                                 "be split exactly")
    return out
