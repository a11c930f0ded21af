"""Cosmos Predict 2 / 2.5: NVIDIA's layout (``MiniTrainDIT`` of cosmos-predict2), as ComfyUI
builds it (``comfy/ldm/cosmos/predict2.py``), without the ``net.`` prefix of NVIDIA's checkpoints
(ComfyUI strips it; diffusers' conversion strips it when present, so files with and without it
convert).

The renames are diffusers' own (``TRANSFORMER_KEYS_RENAME_DICT_COSMOS_2_0`` of
``convert_cosmos_transformer_checkpoint_to_diffusers``, read from its source); the conversion is
that function, which also drops the buffers the released files hold (``pos_embedder.*``,
``accum_*``, ``_extra_state``). Nothing is fused.

One module diffusers' 2.0 map does not name: the learnable per-axis position embedding
(``extra_pos_embed_type="learnable"``, diffusers' ``learnable_pos_embed``; no released Predict 2
model has one, the family's tiny preset does). NVIDIA's and ComfyUI's ``MiniTrainDIT`` call it
``extra_pos_embedder``, the name diffusers' Cosmos 1.0 map (``TRANSFORMER_KEYS_RENAME_DICT_COSMOS_1_0``)
gives it; :func:`cosmos_from_original` renames it so before handing the rest to diffusers' function.

Cosmos 1.0 (``GeneralDIT``, ``blocks.blockN.blocks.M.block...``) is not this layout: diffusers'
function converts its files too (recognised by their ``net.`` key), but the family does not model
its EDM objective, and :func:`cosmos_to_original` writes the Predict 2 layout only.
"""

from __future__ import annotations

from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers as _diffusers_convert

from . import OriginalLayout, StateDict, register_layout
from .renames import diffusers_renames, rename_all


def _learnable() -> tuple[str, str]:
    """``(original, diffusers)`` module name of the learnable position embedding (diffusers' 1.0 map)."""
    pairs = dict(diffusers_renames(_diffusers_convert, "TRANSFORMER_KEYS_RENAME_DICT_COSMOS_1_0"))
    return "extra_pos_embedder", pairs["extra_pos_embedder"]


def cosmos_to_original(state: StateDict) -> StateDict:
    """``CosmosTransformer3DModel`` keys -> the Predict 2 layout (renames only). A new dict.

    Raises:
        LayoutError: a key no original key maps to.
    """
    original, learnable = _learnable()
    renamed = rename_all(state, diffusers_renames(_diffusers_convert, "TRANSFORMER_KEYS_RENAME_DICT_COSMOS_2_0"),
                         skip=(learnable + ".",))
    return {(original + k[len(learnable):] if k.startswith(learnable + ".") else k): v for k, v in renamed.items()}


def cosmos_from_original(checkpoint: StateDict) -> StateDict:
    """The released layout (with or without ``net.``) -> diffusers keys; consumes ``checkpoint``."""
    original, learnable = _learnable()
    for key in [k for k in checkpoint if k.removeprefix("net.").startswith(original + ".")]:
        checkpoint[learnable + key.removeprefix("net.")[len(original):]] = checkpoint.pop(key)
    return _diffusers_convert(checkpoint)


COSMOS = register_layout(OriginalLayout("cosmos", cosmos_to_original, cosmos_from_original,
                                        "NVIDIA's Cosmos Predict 2 layout (MiniTrainDIT); diffusers' "
                                        "convert_cosmos_transformer_checkpoint_to_diffusers"))
