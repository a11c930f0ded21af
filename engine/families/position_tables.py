"""The position tables of the diffusers model classes, one function per kind: model config ->
:class:`~.limits.Limits` (a family adapter's ``limits``). Each docstring says where the class
fails past its table; tests/data/test_limits.py runs the tiny models at and one token past it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .limits import Limits


def _patches(value: Any) -> tuple[int, int, int]:
    """``(t, h, w)`` of a config ``patch_size``: an int (spatial, one frame) or a 3-tuple."""
    if isinstance(value, (list, tuple)):
        return (value[0], value[1], value[2]) if len(value) == 3 else (1, value[-1], value[-1])
    return 1, int(value or 1), int(value or 1)


def pos_embed_grid(cfg: Mapping[str, Any]) -> Limits:
    """SD3 / OmniGen: ``PatchEmbed.cropped_pos_embed`` crops a ``pos_embed_max_size`` square of
    tokens and raises past it (``Height (17) cannot be greater than `pos_embed_max_size`: 16.``)."""
    size = cfg.get("pos_embed_max_size")
    return Limits(grid=(size, size), source=f"pos_embed_max_size {size}") if size else Limits()


def auraflow_grid(cfg: Mapping[str, Any]) -> Limits:
    """AuraFlow: ``pe_selection_index_based_on_dim`` takes a centred crop of the
    ``sqrt(pos_embed_max_size)``-square grid of learned embeddings: a taller grid indexes past the
    table (IndexError), a wider one wraps into the next rows (wrong positions, no error)."""
    side = math.isqrt(cfg["pos_embed_max_size"])
    return Limits(grid=(side, side), source=f"pos_embed_max_size {cfg['pos_embed_max_size']} = {side}^2")


def wan_rope(cfg: Mapping[str, Any]) -> Limits:
    """Wan / Wan VACE / Sana Video: ``WanRotaryPosEmbed`` holds ``rope_max_seq_len`` rows per axis;
    the frame, height and width token counts each index it (a longer one fails in a ``view``)."""
    rows = cfg["rope_max_seq_len"]
    t = _patches(cfg.get("patch_size"))[0]
    return Limits(grid=(rows, rows), frames=rows * t, source=f"rope_max_seq_len {rows}")


def cosmos_positions(cfg: Mapping[str, Any]) -> Limits:
    """Cosmos: ``max_size`` (latent frames, height, width) over ``patch_size``. The learnable extra
    embedding (``extra_pos_embed_type="learnable"``) holds exactly those rows per axis; the rotary
    table alone holds the largest of them for every axis."""
    t, h, w = _patches(cfg.get("patch_size"))
    sizes = [s // p for s, p in zip(cfg["max_size"], (t, h, w))]
    if cfg.get("extra_pos_embed_type") != "learnable":
        sizes = [max(sizes)] * 3
    return Limits(grid=(sizes[1], sizes[2]), frames=sizes[0] * t,
                  source=f"max_size {tuple(cfg['max_size'])} / patch {(t, h, w)}")


def axes_lens(text_margin: int = 1, text_multiple: int = 1):
    """Lumina 2 / Z-Image: rotary tables of ``axes_lens`` rows per axis: rows and columns index
    axes 1 and 2; the caption's token positions index axis 0 and the image tokens sit after them
    (Lumina 2 at ``cap_len``, Z-Image at ``cap_len + 1`` after padding the caption to a multiple of
    32), so ``text`` is what axis 0 leaves them."""
    def limits(cfg: Mapping[str, Any]) -> Limits:
        lens = tuple(cfg["axes_lens"])
        text = (lens[0] - text_margin) // text_multiple * text_multiple
        return Limits(grid=(lens[1], lens[2]), text=text, source=f"axes_lens {lens}")
    return limits


def hidream_tokens(cfg: Mapping[str, Any]) -> Limits:
    """HiDream: non-square latents are padded to ``max_seq = max_resolution[0] * max_resolution[1]
    / patch_size ** 2`` tokens (a longer grid fails in the copy); square latents are not padded."""
    res, patch = tuple(cfg["max_resolution"]), cfg["patch_size"]
    if not patch:  # the class's default (None) builds a model that cannot patchify: nothing to bound
        return Limits()
    return Limits(tokens=res[0] * res[1] // (patch * patch), square_tokens=False,
                  source=f"max_resolution {res} / patch {patch}, non-square latents")


def kandinsky5_rope(cfg: Mapping[str, Any]) -> Limits:
    """Kandinsky 5: ``Kandinsky5RoPE3D`` tables of ``max_pos=(128, 128, 128)`` rows and the text's
    ``Kandinsky5RoPE1D`` of 1024, fixed in the class (not config keys); positions index them."""
    t = _patches(cfg.get("patch_size"))[0]
    return Limits(grid=(128, 128), frames=128 * t, text=1024, source="RoPE max_pos 128 (fixed in diffusers)")
