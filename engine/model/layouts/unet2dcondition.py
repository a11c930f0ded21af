"""SD 1.x / SDXL UNet: the LDM / SGM layout (``input_blocks``, ``middle_block``, ``output_blocks``),
as ComfyUI builds it (``comfy/ldm/modules/diffusionmodules/openaimodel.py`` ``UNetModel``).

diffusers' ``convert_ldm_unet_checkpoint`` converts it given the diffusers config (it reads
``layers_per_block`` there to number the blocks, and ``addition_embed_type`` / ``class_embed_type``
to pick the embedding keys), so this layout ``needs_config``. Its renames are diffusers' own: the
top-level keys from ``DIFFUSERS_TO_LDM_MAPPING["unet"]`` and a resnet's from the ``str.replace`` chain
of ``update_unet_resnet_ldm_to_diffusers`` (read from its source); attention modules keep their inner
names. The block numbering is that function's (``L = layers_per_block``): ``input_blocks.{1 + b(L+1) + j}`` holds down block
``b``'s resnet and attention ``j`` (``.0``, ``.1``; ``j = L`` its downsampler ``.0.op``), ``middle_block``
holds resnet, attention, resnet, and ``output_blocks.{b(L+1) + j}`` up block ``b``'s resnet and attention
``j`` (``j <= L``) with the upsampler after them (``.1.conv``, or ``.2.conv`` after an attention). Only keys are
renamed: tensors are unchanged, so the inverse is row-wise.

ComfyUI names a UNet's LoRA ``lora_unet_<original key with underscores>`` (kohya).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Any, Mapping

from diffusers.loaders import single_file_utils

from . import OriginalLayout, StateDict, register_layout
from .flux import indices
from .renames import LayoutError, Pairs, inverse_rename

PREFIX = "model.diffusion_model."
"""The key prefix diffusers' UNet conversion selects (``LDM_UNET_KEY``)."""


@functools.cache
def replace_chain(function) -> Pairs:
    """The ``(old, new)`` pairs of the ``.replace("old", "new")`` calls with literal arguments in
    ``function``'s source, in source order.

    Raises:
        LayoutError: there are none (the diffusers version changed the function).
    """
    calls = [node for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function))))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
             and len(node.args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)]
    if not calls:
        raise LayoutError(f"diffusers' {function.__name__} has no str.replace chain")
    calls.sort(key=lambda c: (c.args[0].lineno, c.args[0].col_offset))
    return tuple((c.args[0].value, c.args[1].value) for c in calls)


def _top() -> dict[str, str]:
    """``{diffusers key: original key}`` of the UNet's top-level weights (diffusers' table)."""
    table = single_file_utils.DIFFUSERS_TO_LDM_MAPPING["unet"]
    return {**table["layers"], **table["class_embed_type"], **table["addition_embed_type"]}


_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)$")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)\.(.+)$")


def unet_to_original(state: StateDict) -> StateDict:
    """``UNet2DConditionModel`` keys -> the LDM / SGM layout (renames only). A new dict.

    ``layers_per_block`` is read from the keys (the resnets of down block 0).

    Raises:
        LayoutError: a key no original key maps to.
    """
    top = _top()
    resnet = replace_chain(single_file_utils.update_unet_resnet_ldm_to_diffusers)
    per = len(indices(state, "down_blocks.0.resnets.")) + 1  # blocks per level: the resnets and a down/upsampler
    up_attention = {int(k.split(".")[1]) for k in state if k.startswith("up_blocks.") and ".attentions." in k}
    out: StateDict = {}
    for key, tensor in state.items():
        if key in top:
            out[top[key]] = tensor
            continue
        block, mid = _BLOCK.match(key), _MID.match(key)
        if block:
            side, b, kind, j, rest = block.groups()
            b, j = int(b), int(j)
            if side == "down_blocks":
                name = {"resnets": f"input_blocks.{1 + b * per + j}.0.", "attentions": f"input_blocks.{1 + b * per + j}.1.",
                        "downsamplers": f"input_blocks.{1 + b * per + per - 1}.0.op."}[kind]
            else:
                name = {"resnets": f"output_blocks.{b * per + j}.0.", "attentions": f"output_blocks.{b * per + j}.1.",
                        "upsamplers": f"output_blocks.{b * per + per - 1}.{2 if b in up_attention else 1}."}[kind]
            if kind in ("downsamplers", "upsamplers"):
                rest = rest.removeprefix("conv.") if kind == "downsamplers" else rest
        elif mid:
            kind, n, rest = mid.groups()
            name = f"middle_block.{2 * int(n) if kind == 'resnets' else 1 + int(n)}."
        else:
            raise LayoutError(f"diffusers key {key!r}: no key of the LDM UNet layout maps to it")
        out[name + (inverse_rename(rest, resnet) if kind == "resnets" else rest)] = tensor
    return out


def unet_from_original(checkpoint: StateDict, config: Mapping[str, Any]) -> StateDict:
    """The LDM / SGM layout -> diffusers keys: diffusers' ``convert_ldm_unet_checkpoint`` under
    ``config`` (the keys given the ``model.diffusion_model.`` prefix it selects). Consumes ``checkpoint``.

    Raises:
        KeyError: an embedding ``config`` asks for is missing.
    """
    full = {(k if k.startswith(PREFIX) else PREFIX + k): checkpoint.pop(k) for k in list(checkpoint)}
    converted = single_file_utils.convert_ldm_unet_checkpoint(full, dict(config))
    return {k: v for k, v in converted.items() if v is not None}


UNET2DCONDITION = register_layout(OriginalLayout(
    "unet2dcondition", unet_to_original, unet_from_original,
    "the LDM / SGM UNet layout (Stability AI's SD 1.x / SDXL); diffusers' convert_ldm_unet_checkpoint",
    lora_prefix="lora_unet_", needs_config=True))
