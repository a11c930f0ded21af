"""Z-Image (``ZImageTransformer2DModel``): two refiner lists, then the main single-stream list.

Conventions (``pipeline_z_image.py``): the model's time runs the other way, ``t = 1 - sigma``
(it multiplies by ``t_scale`` itself), and it predicts ``x0 - noise``, so :func:`_read_output`
negates it to give the flow velocity ``noise - x0``.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..position_tables import axes_lens
from ..registry import register_family


# The model takes lists of per-sample tensors: latents (C, 1, H, W) each and caption features
# (L_i, D) holding only each prompt's real tokens (as the pipeline passes them).
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "x": list(latents.unsqueeze(2).unbind(0)),
        "t": 1 - sigmas.to(latents.dtype),
        "cap_feats": [seq[mask] for seq, mask in zip(text.seq, text.mask)],
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return -torch.stack(output[0], dim=0).squeeze(2)


# The loops call noise_refiner blocks as block(x, mask, freqs, adaln, noise_mask, t_noisy, t_clean),
# context_refiner blocks as block(cap, mask, freqs) and layers blocks like the noise refiner; every
# block returns the hidden state alone. The omni variant's siglip_refiner is not declared (basic
# text-to-image mode only).
ZIMAGE = register_family(
    FamilyAdapter(
        name="zimage",
        model_class="ZImageTransformer2DModel",
        flow_shift=FlowShift(3.0, mu_rule="z_image.pipeline_z_image:calculate_shift",
                             source="Tongyi-MAI/Z-Image-Turbo scheduler config, as ai-toolkit declares it "
                             "(the Z-Image base checkpoint ships 6.0)"),
        block_lists=(
            BlockList("noise_refiner", "noise_refiner", SINGLE, ffn="feed_forward", attention="attention"),
            BlockList("context_refiner", "context_refiner", SINGLE, ffn="feed_forward", attention="attention"),
            BlockList("layers", "layers", SINGLE, ffn="feed_forward", attention="attention"),
        ),
        text=lambda cfg: TextSpec(cfg["cap_feat_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_channels": 16,
            "dim": 32,
            "n_layers": 8,
            "n_refiner_layers": 2,
            "n_heads": 2,
            "n_kv_heads": 2,
            "cap_feat_dim": 32,
            "axes_dims": (4, 6, 6),  # sums to the head dim
            "axes_lens": (256, 64, 64),
        },
        latent_channels=16,
        limits=axes_lens(text_margin=2, text_multiple=32),
        patch=2,  # the model's all_patch_size (2,): 2x2 latent patches
        notes=(
            "time runs backwards (t = 1 - sigma) and the raw output is x0 - noise; the adapter negates it",
            "omni mode (siglip_refiner, reference images) is not built here",
        ),
    )
)
