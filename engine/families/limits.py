"""The largest inputs a model takes: what its position tables bound, declared per family from the
model config (docs/FAMILIES.md "Model limits" lists them).

A family whose diffusers class embeds positions in a table of fixed size (a learned or fixed
``pos_embed`` cropped to the image, a rotary table of ``rope_max_seq_len`` rows) fails past it
with the library's own message deep inside the first forward; a family declares the table here
so that the run refuses the size before any model is built, and bucketing leaves such buckets
out (``engine/model/limits.py`` applies them). Families whose positions are computed for any
size (sin-cos recomputed per shape, rotary ids computed on the fly) declare none.

Units: ``grid`` and ``tokens`` count image tokens (latent cells / patch per side); ``frames``
counts latent frames; ``text`` counts text tokens.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .base import FamilyAdapter

RESOLUTION_MULTIPLE = 16
"""``resolution`` is a multiple of 16 (``engine/config/data.py``)."""


@dataclass(frozen=True)
class Limits:
    """What one model config takes at most (``None``: no bound).

    Attributes:
        grid: ``(rows, cols)``: the most image tokens per column and per row.
        tokens: the most image tokens ``rows * cols``.
        square_tokens: ``tokens`` binds square grids too (HiDream pads only non-square latents
            to its ``max_seq``: square ones are not bounded).
        frames: the most latent frames.
        text: the most text tokens; the text encoders' ``max_length`` when the model says no less.
        source: the config entries the bounds come from, e.g. ``pos_embed_max_size 16``.
    """

    grid: tuple[int, int] | None = None
    tokens: int | None = None
    square_tokens: bool = True
    frames: int | None = None
    text: int | None = None
    source: str = ""

    @property
    def spatial(self) -> bool:
        """Whether the image grid is bounded at all."""
        return self.grid is not None or self.tokens is not None

    def fits(self, rows: int, cols: int) -> bool:
        """Whether an image grid of ``rows x cols`` tokens (one frame) is within the bounds."""
        if self.grid is not None and (rows > self.grid[0] or cols > self.grid[1]):
            return False
        bound = self.tokens is not None and (self.square_tokens or rows != cols)
        return not (bound and rows * cols > self.tokens)


def merge_text(limits: Limits | None, max_length: int | None) -> Limits:
    """``limits`` (``None``: none) with ``text`` the smaller of its own and ``max_length``."""
    limits = limits or Limits()
    texts = [t for t in (limits.text, max_length) if t is not None]
    return Limits(limits.grid, limits.tokens, limits.square_tokens, limits.frames,
                  min(texts) if texts else None, limits.source)


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


def model_limits(family: FamilyAdapter, cfg: Mapping[str, Any]) -> Limits:
    """The limits of ``family`` at model config ``cfg``: its
    declared ``limits`` (none when it declares none) with ``text`` bounded by its text encoders'
    ``max_length`` (what the pipeline pads to; counting truncated captions is the encoder's)."""
    declared = family.limits(cfg) if family.limits is not None else None
    recipe = family.text_encoders
    return merge_text(declared, recipe.max_length if recipe is not None else None)


def _spatial(value: Any) -> int | None:
    """The spatial entry of a config ``patch_size``: an int, or the last of a ``(t, h, w)`` tuple."""
    if isinstance(value, (list, tuple)) and value:
        value = value[-1]
    return value if isinstance(value, int) and value >= 1 else None


def token_patch(family: FamilyAdapter, config: Mapping[str, Any]) -> int:
    """Latent cells per image token side: the family's declared ``patch`` (families that pack the
    latents themselves: Flux's 2x2), else the transformer config's spatial ``patch_size``, else 1."""
    return family.patch or _spatial(config.get("patch_size")) or 1


def full_config(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` over the defaults of ``cls.__init__`` (what ``cls.from_config(values).config`` holds)."""
    params = inspect.signature(cls.__init__).parameters.values()
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {**defaults, **{k: v for k, v in values.items() if not k.startswith("_")}}


def largest_square(limits: Limits, patch: int, downscale: int, ceiling: int) -> int | None:
    """The largest ``resolution`` (a multiple of 16, at most ``ceiling``) whose square's token
    grid ``resolution // downscale // patch`` per side fits ``limits``; ``None``: none fits."""
    for side in range(ceiling // RESOLUTION_MULTIPLE * RESOLUTION_MULTIPLE, 0, -RESOLUTION_MULTIPLE):
        cells = side // downscale // patch
        if limits.fits(cells, cells):
            return side
    return None


def describe_bound(limits: Limits, patch: int, downscale: int) -> str:
    """How the largest sizes follow from the config: ``16x16 tokens (pos_embed_max_size 16) x patch 2
    x VAE 8``, or ``4096 tokens (max_resolution (128, 128) / patch 2, non-square latents)``."""
    if limits.grid is not None:
        return f"{limits.grid[0]}x{limits.grid[1]} tokens ({limits.source}) x patch {patch} x VAE {downscale}"
    return f"{limits.tokens} tokens ({limits.source})"
