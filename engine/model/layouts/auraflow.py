"""AuraFlow: fal's layout (cloneofsimo's MMDiT), as ComfyUI builds it (``comfy/ldm/aura/mmdit.py``).

diffusers' ``convert_auraflow_transformer_checkpoint_to_diffusers`` converts it at any width: it
renames module by module in explicit code (no rename table to read) and swaps the final
modulation's halves (``modF.1``: ``[shift; scale]`` -> ``[scale; shift]``). :func:`auraflow_to_original`
is its inverse, written from that code and checked by round trip (``tests/model/test_layouts_image.py``);
it only renames, and swaps ``modF.1`` back along dim 0.
"""

from __future__ import annotations

from . import OriginalLayout, StateDict, diffusers_converter, register_layout
from .flux import indices, swap_halves
from .renames import LayoutError

_TOP = {  # diffusers key -> original key
    "register_tokens": "register_tokens",
    "pos_embed.pos_embed": "positional_encoding",
    "pos_embed.proj.weight": "init_x_linear.weight", "pos_embed.proj.bias": "init_x_linear.bias",
    "time_step_proj.linear_1.weight": "t_embedder.mlp.0.weight", "time_step_proj.linear_1.bias": "t_embedder.mlp.0.bias",
    "time_step_proj.linear_2.weight": "t_embedder.mlp.2.weight", "time_step_proj.linear_2.bias": "t_embedder.mlp.2.bias",
    "context_embedder.weight": "cond_seq_linear.weight",
    "proj_out.weight": "final_linear.weight",
}
_FF = {"linear_1": "c_fc1", "linear_2": "c_fc2", "out_projection": "c_proj"}
_JOINT = {  # joint_transformer_blocks.N.<diffusers module> -> double_layers.N.<original module>
    **{f"ff.{d}": f"mlpX.{o}" for d, o in _FF.items()}, **{f"ff_context.{d}": f"mlpC.{o}" for d, o in _FF.items()},
    "norm1.linear": "modX.1", "norm1_context.linear": "modC.1",
    "attn.to_q": "attn.w2q", "attn.to_k": "attn.w2k", "attn.to_v": "attn.w2v", "attn.to_out.0": "attn.w2o",
    "attn.add_q_proj": "attn.w1q", "attn.add_k_proj": "attn.w1k", "attn.add_v_proj": "attn.w1v",
    "attn.to_add_out": "attn.w1o",
}
_SINGLE = {  # single_transformer_blocks.N.<diffusers module> -> single_layers.N.<original module>
    **{f"ff.{d}": f"mlp.{o}" for d, o in _FF.items()}, "norm1.linear": "modCX.1",
    "attn.to_q": "attn.w1q", "attn.to_k": "attn.w1k", "attn.to_v": "attn.w1v", "attn.to_out.0": "attn.w1o",
}


def auraflow_to_original(state: StateDict) -> StateDict:
    """``AuraFlowTransformer2DModel`` keys -> fal's layout (renames; ``modF.1`` halves swapped). A new dict.

    Raises:
        LayoutError: keys the mapping does not know are left over (named).
    """
    sd, out = dict(state), {}
    for new, old in _TOP.items():
        if new in sd:
            out[old] = sd.pop(new)
    if "norm_out.linear.weight" in sd:
        out["modF.1.weight"] = swap_halves(sd.pop("norm_out.linear.weight"))
    for prefix, original, table in (("joint_transformer_blocks.", "double_layers.", _JOINT),
                                    ("single_transformer_blocks.", "single_layers.", _SINGLE)):
        for i in indices(sd, prefix):
            for new, old in table.items():
                if f"{prefix}{i}.{new}.weight" in sd:
                    out[f"{original}{i}.{old}.weight"] = sd.pop(f"{prefix}{i}.{new}.weight")
    if sd:
        raise LayoutError(f"keys the AuraFlow mapping does not know: {', '.join(sorted(sd)[:5])}")
    return out


AURAFLOW = register_layout(OriginalLayout("auraflow", auraflow_to_original,
                                          diffusers_converter("AuraFlowTransformer2DModel"),
                                          "fal's AuraFlow MMDiT layout; diffusers' "
                                          "convert_auraflow_transformer_checkpoint_to_diffusers"))
