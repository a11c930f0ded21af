"""Cosmos Predict 2 / 2.5 (``CosmosTransformer3DModel``): one list of DiT blocks over video latents.

Source read: ``diffusers/models/transformers/transformer_cosmos.py`` (diffusers 0.42.1), with
``pipelines/cosmos/pipeline_cosmos2_text2image.py`` and ``pipeline_cosmos2_5_predict.py`` for how
the transformer is called.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..frames import WAN_VAE
from ..lazy import torch
from ..position_tables import cosmos_positions
from ..registry import register_family

_FPS = 16  # the video2world pipelines' default; images (one frame) are passed without fps


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # The Predict 2 pipelines turn their EDM sigma into the rectified-flow time t = sigma / (sigma + 1)
    # and feed x_t = (1 - t) x0 + t noise; Predict 2.5 uses flow sigmas directly. In both the timestep
    # is t in [0, 1] and the output is the velocity noise - x0. The padding mask is zeros, as in the
    # pipelines.
    b, c, f, h, w = latents.shape
    inputs = {
        "hidden_states": latents,
        "timestep": sigmas.to(latents.dtype),
        # the pipelines zero the embeddings past each prompt's length and pass no attention mask
        "encoder_hidden_states": text.seq * text.mask.unsqueeze(-1).to(text.seq.dtype),
        "padding_mask": latents.new_zeros(1, 1, h, w),
        "return_dict": False,
    }
    if model.config.in_channels > c:  # Predict 2.5: condition mask channel, no conditioning frames
        inputs["condition_mask"] = latents.new_zeros(b, model.config.in_channels - c, f, h, w)
    if f > 1:
        inputs["fps"] = _FPS
    return inputs


def _text(cfg) -> TextSpec:
    # Predict 2.5 projects concatenated Qwen2.5-VL layer states through crossattn_proj
    if cfg["use_crossattn_projection"]:
        return TextSpec(cfg["crossattn_proj_in_channels"])
    return TextSpec(cfg["text_embed_dim"])


# block(hidden, encoder, embedded_timestep, temb, rotary_emb, extra_pos_emb, attention_mask,
# controlnet_residual) -> hidden: the plain single-tensor carry. controlnet_residual differs per
# block only when ControlNet hidden states are given (Cosmos Transfer, not modelled: the runner
# detects the change and falls back to per-block); otherwise it is None for every block.
# FFN boundary ff; attention boundary the self-attention attn1.
COSMOS = register_family(
    FamilyAdapter(
        name="cosmos",
        model_class="CosmosTransformer3DModel",
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention="attn1"),),
        text=_text,
        make_inputs=_make_inputs,
        tiny_config={
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "num_layers": 8,
            "mlp_ratio": 2.0,
            "text_embed_dim": 32,
            "adaln_lora_dim": 8,
            "max_size": (16, 128, 128),  # latent frames, height, width the positions cover
            "patch_size": (1, 2, 2),
            # the real checkpoints concatenate the padding mask, which diffusers resizes with
            # torchvision (not a dependency of this project); the tiny preset leaves it out
            "concat_padding_mask": False,
        },
        latent_channels=16,
        limits=cosmos_positions,
        video_latents=True,
        frames=WAN_VAE,
        notes=(
            "Cosmos Predict 2 (T5 text, 16-channel Wan 2.1 VAE) and Predict 2.5 (Qwen2.5-VL text through "
            "crossattn_proj, condition-mask channel zero); Cosmos 1.0 checkpoints use an EDM "
            "preconditioning that the flow objective does not model",
            "real checkpoints (concat_padding_mask=True) need torchvision installed: diffusers resizes the "
            "padding mask with torchvision.transforms; the tiny preset sets concat_padding_mask=False",
            "ControlNet (Cosmos Transfer) residuals are not modelled: the runner falls back to per-block",
            "attention boundary is the self-attention attn1; the cross-attention attn2 stays in the block",
            "image/video-conditioned generation (conditioning frames, per-frame timesteps) is not built here",
        ),
    )
)
