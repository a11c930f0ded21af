"""The largest inputs a model takes: what its position tables bound, per family from the model
config. A class that crops a fixed ``pos_embed`` or indexes a rotary table of fixed rows fails past
it deep in the first forward; a family declares the table so that the run refuses the size before
any model is built and bucketing leaves such buckets out (``engine/data/limits.py``; the tables:
``engine/families/position_tables.py``). Families whose positions are computed for any size
declare none (docs/FAMILIES.md "Model limits" lists them).
Units: ``grid`` and ``tokens`` count image tokens (latent cells / patch per side), ``frames``
latent frames, ``text`` text tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

RESOLUTION_MULTIPLE = 16
"""``resolution`` is a multiple of 16 (``engine/config/data.py``)."""


class LimitedFamily(Protocol):
    """What this module reads of a family adapter (``engine/families/base.py`` ``FamilyAdapter``,
    which imports :class:`Limits`: a protocol keeps the import one way): its declared ``limits``,
    its ``text_encoders`` recipe (their ``max_length``) and its token ``patch``."""

    limits: Callable[[Mapping[str, Any]], Limits] | None
    text_encoders: Any
    patch: int | None


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


def model_limits(family: LimitedFamily, cfg: Mapping[str, Any]) -> Limits:
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


def token_patch(family: LimitedFamily, config: Mapping[str, Any]) -> int:
    """Latent cells per image token side: the family's declared ``patch`` (families that pack the
    latents themselves: Flux's 2x2), else the transformer config's spatial ``patch_size``, else 1."""
    return family.patch or _spatial(config.get("patch_size")) or 1


def temporal_patch(config: Mapping[str, Any]) -> int:
    """Latent frames per token: the config's ``patch_size_t`` (HunyuanVideo, LTX-Video), else the
    first entry of a ``(t, h, w)`` ``patch_size`` (Wan), else 1."""
    value = config.get("patch_size_t")
    if value is None and isinstance(config.get("patch_size"), (list, tuple)) and len(config["patch_size"]) == 3:
        value = config["patch_size"][0]
    return value if isinstance(value, int) and value >= 1 else 1


def token_count(family: LimitedFamily, config: Mapping[str, Any], latent_shape: tuple[int, ...]) -> int:
    """The transformer's latent token count of one sample: latent frames / temporal patch x
    (h / patch) x (w / patch) (each rounded up, as the patch embedding pads).

    Args:
        latent_shape: one sample's latents, ``(C, h, w)`` (an image) or ``(C, F', h, w)`` (F'
            latent frames), in latent cells.
    """
    h, w = latent_shape[-2:]
    frames = latent_shape[1] if len(latent_shape) == 4 else 1
    p, pt = token_patch(family, config), temporal_patch(config)
    return -(-frames // pt) * -(-h // p) * -(-w // p)


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
