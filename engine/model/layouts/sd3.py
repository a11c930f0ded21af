"""SD3 / SD3.5: Stability AI's MMDiT layout (``sd3-ref`` / ``sd3_impls``), as ComfyUI builds it.

diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers`` converts it at any width; the
inverse joins each block's q, k, v into ``attn.qkv`` and reorders the ``[shift; scale]``
modulations diffusers swaps (the final layer's and the last block's context modulation).
"""

from __future__ import annotations

import torch

from . import OriginalLayout, StateDict, diffusers_converter, register_layout
from .flux import swap_halves


def _rename(sd: dict, out: dict, pairs) -> None:
    """``(original, diffusers)`` module pairs: weight and bias moved from ``sd`` to ``out``."""
    for new, old in pairs:
        for p in ("weight", "bias"):
            if f"{old}.{p}" in sd:
                out[f"{new}.{p}"] = sd.pop(f"{old}.{p}")


def sd3_to_original(state: StateDict) -> StateDict:
    """``SD3Transformer2DModel`` keys -> Stability AI's MMDiT layout (SD3 / SD3.5), row-wise; a new dict.

    Raises:
        KeyError: keys the mapping does not know are left over (named).
    """
    sd, out = dict(state), {"pos_embed": state["pos_embed.pos_embed"]}
    sd.pop("pos_embed.pos_embed")
    _rename(sd, out, [("x_embedder.proj", "pos_embed.proj"), ("context_embedder", "context_embedder"),
                      ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                      ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                      ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                      ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
                      ("final_layer.linear", "proj_out")])
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = swap_halves(sd.pop(f"norm_out.linear.{p}"))
    last = max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    for i in range(last + 1):
        a, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        _rename(sd, out, [(x + "attn.proj", a + "attn.to_out.0"), (c + "attn.proj", a + "attn.to_add_out"),
                          (x + "attn2.proj", a + "attn2.to_out.0"), (x + "adaLN_modulation.1", a + "norm1.linear"),
                          (x + "mlp.fc1", a + "ff.net.0.proj"), (x + "mlp.fc2", a + "ff.net.2"),
                          (c + "mlp.fc1", a + "ff_context.net.0.proj"), (c + "mlp.fc2", a + "ff_context.net.2")])
        for p in ("weight", "bias"):
            out[f"{x}attn.qkv.{p}"] = torch.cat([sd.pop(f"{a}attn.to_{q}.{p}") for q in "qkv"])
            out[f"{c}attn.qkv.{p}"] = torch.cat([sd.pop(f"{a}attn.add_{q}_proj.{p}") for q in "qkv"])
            if f"{a}attn2.to_q.{p}" in sd:
                out[f"{x}attn2.qkv.{p}"] = torch.cat([sd.pop(f"{a}attn2.to_{q}.{p}") for q in "qkv"])
            mod = sd.pop(f"{a}norm1_context.linear.{p}")
            out[f"{c}adaLN_modulation.1.{p}"] = swap_halves(mod) if i == last else mod
        for new, old in [(x + "attn.ln_q", "attn.norm_q"), (x + "attn.ln_k", "attn.norm_k"),
                         (c + "attn.ln_q", "attn.norm_added_q"), (c + "attn.ln_k", "attn.norm_added_k"),
                         (x + "attn2.ln_q", "attn2.norm_q"), (x + "attn2.ln_k", "attn2.norm_k")]:
            if f"{a}{old}.weight" in sd:
                out[f"{new}.weight"] = sd.pop(f"{a}{old}.weight")
    if sd:
        raise KeyError(f"keys the SD3 mapping does not know: {', '.join(sorted(sd)[:5])}")
    return out


SD3 = register_layout(OriginalLayout("sd3", sd3_to_original, diffusers_converter("SD3Transformer2DModel"),
                                     "Stability AI's MMDiT layout; diffusers' convert_sd3_transformer_checkpoint_to_diffusers"))
