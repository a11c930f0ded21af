"""LoRA hyper-parameters (read by ``engine/model/lora_files.py``, which injects the adapter with
peft and writes its files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import ConfigError, check_options, option


class LoraConfigError(ConfigError):
    """A LoRA setting is invalid; the message names the key, the value and what is allowed."""


LORA_TYPES = ("lora", "lokr", "loha")
"""peft's adapters trained here: LoRA (Hu et al., 2021), LoKr (Kronecker product, LyCORIS) and LoHa
(Hadamard product, LyCORIS): ``peft.LoraConfig``, ``LoKrConfig``, ``LoHaConfig``."""

TARGET_PRESETS = ("attention", "all-linear")
"""``lora_target_modules`` presets: ``attention``, the family's attention projections (its
``lora_targets``, the default); ``all-linear``, every ``nn.Linear`` inside the family's block lists,
resolved from the model at injection (``engine/model/lora_files.py`` ``target_modules``)."""


def _lora_type(value: Any) -> Any:
    """``lora_type``; SimpleTuner's ``standard`` (its plain LoRA) reads as ``lora``; its ``lycoris``
    names no algorithm here.

    Raises:
        LoraConfigError: ``lycoris``, naming the algorithms allowed.
    """
    if value == "lycoris":
        raise LoraConfigError(f"lora_type={value!r} is invalid: allowed {', '.join(LORA_TYPES)} (SimpleTuner's "
                              "lycoris: name its algorithm, lokr or loha).")
    return "lora" if value == "standard" else value


def _module_names(value: Any) -> Any:
    """``lora_target_modules``: a preset (:data:`TARGET_PRESETS`; ``attention`` reads as unset, the
    default), one module name, a non-empty list of names, or unset."""
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value
    if names is not None and not (isinstance(names, tuple) and names and all(isinstance(v, str) and v for v in names)):
        raise LoraConfigError(f"lora_target_modules={value!r} is invalid: allowed a preset "
                              f"({', '.join(TARGET_PRESETS)}), a module name or a non-empty list of module names "
                              "(strings).")
    presets = [v for v in names or () if v in TARGET_PRESETS]
    if presets and len(names) > 1:
        raise LoraConfigError(f"lora_target_modules={value!r} is invalid: the preset {presets[0]!r} stands alone; "
                              f"allowed one preset ({', '.join(TARGET_PRESETS)}) or a list of module names.")
    return None if names == ("attention",) else names


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters. Validated at construction.

    Attributes:
        rank: LoRA rank r >= 1 (LoKr: the rank of its decomposed Kronecker factors; LoHa: of each
            of its two low-rank products).
        alpha: LoRA alpha > 0; the update is scaled by ``alpha / rank`` (Hu et al., 2021; peft's
            ``scaling`` for all three types).
        target_modules: module names to adapt, ``("all-linear",)``, or ``None`` = the family's
            attention projections (the ``attention`` preset).
        dropout: LoRA dropout probability in [0, 1) (LoRA only).
        lora_type: ``lora``, ``lokr`` or ``loha`` (:data:`LORA_TYPES`).
        use_dora: DoRA (Liu et al., 2024; peft's ``use_dora``): the LoRA's weight is split into a
            trained magnitude per output row and a direction. LoRA only.
        factor: LoKr's Kronecker factor (peft's ``decompose_factor``, LyCORIS' ``factor``); -1: the
            factorization nearest the square root. LoKr only.
        full_matrix: LoKr's factors both whole (LyCORIS' ``full_matrix``), scaled by 1: rank and alpha
            unused (``engine/model/adapters.py`` ``FULL_RANK``). LoKr only.
        init: peft ``init_lora_weights`` / ``init_weights`` (``True`` = the update starts at zero).

    Raises:
        LoraConfigError: rank < 1, alpha <= 0, dropout outside [0, 1), an empty target list, a
            preset beside module names; DoRA or dropout with ``lokr`` / ``loha``; a factor of 0, or one
            other than -1, or a full matrix, without ``lokr``.
    """

    rank: int = option(16, "LoRA rank r.", "--rank", key="lora_rank", min=1, max=4096)
    alpha: float = option(16.0, "LoRA alpha; the update is scaled by alpha / rank.", "--alpha", key="lora_alpha",
                          above=0, max=1e30)
    target_modules: tuple[str, ...] | None = option(
        None, "Module names to adapt, or a preset: attention (the family's attention projections, the default) or "
        "all-linear (every Linear layer inside the transformer blocks); docs/RECIPES.md says which peer trains "
        "which by default.", "--targets",
        key="lora_target_modules", parse=_module_names)
    dropout: float = option(0.0, "LoRA dropout probability.", "--lora-dropout", key="lora_dropout", min=0, below=1,
                            step=0.01)
    lora_type: str = option("lora", "The adapter (peft): lora, lokr (LyCORIS' Kronecker product) or loha (its "
                            "Hadamard product).", "--lora-type", key="lora_type", choices=LORA_TYPES,
                            parse=_lora_type)
    use_dora: bool = option(False, "DoRA: a LoRA whose update is split into a magnitude per output row and a "
                            "direction (peft's use_dora); lora_type lora only.", "--use-dora", key="use_dora")
    factor: int = option(-1, "LoKr's Kronecker factor (LyCORIS' factor, peft's decompose_factor): each weight's "
                         "factor matrix w1 has at most this many rows and columns; -1: the factorization nearest "
                         "the square root. lora_type lokr only.", "--lokr-factor", key="lokr_factor", min=-1,
                         max=65536)
    full_matrix: bool = option(False, "LoKr with both Kronecker factors as full matrices (LyCORIS' full_matrix, as "
                               "SimpleTuner's LoKr examples train): no low-rank factor, the update scaled by 1, so "
                               "lora_rank and lora_alpha are not used. lora_type lokr only.", "--lokr-full-matrix",
                               key="lokr_full_matrix")
    init: bool | str = True

    def __post_init__(self) -> None:
        check_options(self, LoraConfigError)
        if self.lora_type != "lora" and self.use_dora:
            raise LoraConfigError(f"use_dora=True is invalid with lora_type={self.lora_type!r}: allowed false (DoRA "
                                  "decomposes a LoRA; peft's LoKr and LoHa have no magnitude vector), or lora_type "
                                  "lora.")
        if self.full_matrix and self.lora_type != "lokr":
            raise LoraConfigError(f"lokr_full_matrix=True is invalid with lora_type={self.lora_type!r}: allowed false, "
                                  "or lora_type lokr.")
        if self.factor == 0 or self.factor != -1 and self.lora_type != "lokr":
            raise LoraConfigError(f"lokr_factor={self.factor!r} is invalid with lora_type={self.lora_type!r}: allowed "
                                  "-1 (the default), or a factor >= 1 with lora_type lokr.")
        if self.lora_type != "lora" and self.dropout:
            raise LoraConfigError(f"lora_dropout={self.dropout!r} is invalid with lora_type={self.lora_type!r}: "
                                  "allowed 0 (peft's LoKr and LoHa drop ranks or whole modules, not inputs; "
                                  "their dropouts are not offered here), or lora_type lora.")
