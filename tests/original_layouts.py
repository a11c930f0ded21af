"""The published original-release key layouts, reversed from diffusers' conversion: Black Forest
Labs' Flux.1 reference code and Stability AI's MMDiT (SD3 / SD3.5). Tests write tiny models in
these layouts to load them as users' single files are loaded (by the pack and by ComfyUI); each
mapping is checked by round-tripping through diffusers' own forward conversion
(tests/model/test_single_file.py).
"""

from __future__ import annotations

import torch


def _swap(t):  # diffusers [scale; shift] <-> original [shift; scale]
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _rename(sd, out, pairs):
    for new, old in pairs:
        for p in ("weight", "bias"):
            if f"{old}.{p}" in sd:
                out[f"{new}.{p}"] = sd.pop(f"{old}.{p}")


def flux_to_bfl(state: dict) -> dict:
    """``FluxTransformer2DModel`` keys -> Black Forest Labs' Flux.1 layout."""
    sd, out = dict(state), {}
    _rename(sd, out, [("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
                      ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
                      ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
                      ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
                      ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
                      ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
                      ("txt_in", "context_embedder"), ("img_in", "x_embedder"), ("final_layer.linear", "proj_out")])
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = _swap(sd.pop(f"norm_out.linear.{p}"))
    blocks = {int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")}
    for i in sorted(blocks):
        a, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        _rename(sd, out, [(b + "img_mod.lin", a + "norm1.linear"), (b + "txt_mod.lin", a + "norm1_context.linear"),
                          (b + "img_mlp.0", a + "ff.net.0.proj"), (b + "img_mlp.2", a + "ff.net.2"),
                          (b + "txt_mlp.0", a + "ff_context.net.0.proj"), (b + "txt_mlp.2", a + "ff_context.net.2"),
                          (b + "img_attn.proj", a + "attn.to_out.0"), (b + "txt_attn.proj", a + "attn.to_add_out")])
        for p in ("weight", "bias"):
            out[f"{b}img_attn.qkv.{p}"] = torch.cat([sd.pop(f"{a}attn.to_{x}.{p}") for x in "qkv"])
            out[f"{b}txt_attn.qkv.{p}"] = torch.cat([sd.pop(f"{a}attn.add_{x}_proj.{p}") for x in "qkv"])
        for new, old in [("img_attn.norm.query_norm", "norm_q"), ("img_attn.norm.key_norm", "norm_k"),
                         ("txt_attn.norm.query_norm", "norm_added_q"), ("txt_attn.norm.key_norm", "norm_added_k")]:
            out[f"{b}{new}.scale"] = sd.pop(f"{a}attn.{old}.weight")
    singles = {int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks.")}
    for i in sorted(singles):
        a, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        _rename(sd, out, [(b + "modulation.lin", a + "norm.linear"), (b + "linear2", a + "proj_out")])
        for p in ("weight", "bias"):
            out[f"{b}linear1.{p}"] = torch.cat([sd.pop(f"{a}attn.to_{x}.{p}") for x in "qkv"]
                                               + [sd.pop(f"{a}proj_mlp.{p}")])
        out[f"{b}norm.query_norm.scale"] = sd.pop(f"{a}attn.norm_q.weight")
        out[f"{b}norm.key_norm.scale"] = sd.pop(f"{a}attn.norm_k.weight")
    assert not sd, sorted(sd)[:5]
    return out


def sd3_to_mmdit(state: dict) -> dict:
    """``SD3Transformer2DModel`` keys -> Stability AI's MMDiT layout (SD3 / SD3.5)."""
    sd, out = dict(state), {"pos_embed": state["pos_embed.pos_embed"]}
    sd.pop("pos_embed.pos_embed")
    _rename(sd, out, [("x_embedder.proj", "pos_embed.proj"), ("context_embedder", "context_embedder"),
                      ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                      ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                      ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                      ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
                      ("final_layer.linear", "proj_out")])
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = _swap(sd.pop(f"norm_out.linear.{p}"))
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
            out[f"{c}adaLN_modulation.1.{p}"] = _swap(mod) if i == last else mod
        for new, old in [(x + "attn.ln_q", "attn.norm_q"), (x + "attn.ln_k", "attn.norm_k"),
                         (c + "attn.ln_q", "attn.norm_added_q"), (c + "attn.ln_k", "attn.norm_added_k"),
                         (x + "attn2.ln_q", "attn2.norm_q"), (x + "attn2.ln_k", "attn2.norm_k")]:
            if f"{a}{old}.weight" in sd:
                out[f"{new}.weight"] = sd.pop(f"{a}{old}.weight")
    assert not sd, sorted(sd)[:5]
    return out


TO_ORIGINAL = {"flux": flux_to_bfl, "sd3": sd3_to_mmdit}
