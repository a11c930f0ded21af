"""Sana-Video (``SanaVideoTransformer3DModel``): one list of linear-attention video DiT blocks.

Source read: ``diffusers/models/transformers/transformer_sana_video.py`` (diffusers 0.42.1), with
``pipelines/sana_video/pipeline_sana_video.py`` for how the transformer is called.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..frames import WAN_VAE
from ..lazy import torch
from ..position_tables import wan_rope
from ..registry import register_family
from ..timesteps import scheduler_timesteps


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the pipeline passes scheduler timesteps
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    prediction = output[0]
    if prediction.shape[1] == 2 * latents.shape[1]:  # learned-sigma checkpoints: as the pipeline
        prediction = prediction.chunk(2, dim=1)[0]
    return prediction


# block(hidden, attention_mask, encoder, encoder_attention_mask, timestep, frames, height, width,
# rotary_emb) -> hidden; the three ints are the post-patch grid, the same for every block, so the
# plain single-tensor carry. ControlNet residuals added between blocks (controlnet_block_samples)
# are not modelled: the runner detects them and falls back to per-block. FFN boundary: ff
# (GLUMBTempConv), one module on the hidden state reshaped to (B, F, H, W, C). The self-attention
# attn1 is linear attention and the documents say attention offload is unsupported for Sana-Video:
# no attention boundary.
SANAVIDEO = register_family(
    FamilyAdapter(
        name="sanavideo",
        model_class="SanaVideoTransformer3DModel",
        flow_shift=FlowShift(8.0, source="SANA-Video: flow_shift 8.0 (diffusers "
                             "scripts/convert_sana_video_to_diffusers.py)"),
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention=None),),
        text=lambda cfg: TextSpec(cfg["caption_channels"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "num_layers": 8,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 16,
            "cross_attention_dim": 32,  # = inner dim: the caption projection's width
            "caption_channels": 32,
            "sample_size": 8,
            "patch_size": (1, 2, 2),
        },
        latent_channels=16,
        limits=wan_rope,
        video_latents=True,
        frames=WAN_VAE,
        notes=(
            "linear attention: attention offload unsupported (documents), no attention boundary declared",
            "latent_channels 16 is the Wan 2.1 VAE of Sana-Video 2B; checkpoints paired with the LTX-2 "
            "video VAE take 128-channel latents",
            "text = Gemma-2 hidden states + mask; guidance_embeds configs are not handled (the "
            "pipeline never passes guidance)",
        ),
    )
)
