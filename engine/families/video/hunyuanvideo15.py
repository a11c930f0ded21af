"""HunyuanVideo 1.5 (``HunyuanVideo15Transformer3DModel``): one list of dual-stream blocks.

Source read: ``diffusers/models/transformers/transformer_hunyuan_video15.py`` (diffusers 0.42.1),
with ``pipelines/hunyuan_video1_5`` for how the transformer is called.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..frames import FrameRule
from ..lazy import torch
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# block(hidden, encoder, temb, encoder_attention_mask, rotary_emb) -> (hidden, encoder)
_CARRY = Carry(((0, 0), (1, 1)))


# HunyuanVideo 1.5 always takes ByT5 glyph embeddings and SigLIP image embeddings. For text-to-video
# without quoted glyph text the pipeline passes them as zeros with an all-false mask; masked
# tokens are masked both as queries and as keys, so their number does not change the prediction.
# One token each instead of the pipeline's 256 / 729 keeps the sequence short.
_HV15_GLYPH_TOKENS = 1


_HV15_IMAGE_TOKENS = 1


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, c = latents.shape[:2]
    cfg = model.config
    # text-to-video: [latents, zero condition latents, zero condition mask] (in_channels = 2C + 1)
    extra = latents.new_zeros((b, cfg.in_channels - c, *latents.shape[2:]))
    return {
        "hidden_states": torch.cat([latents, extra], dim=1),
        "timestep": scheduler_timesteps(sigmas, latents.dtype),
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "encoder_hidden_states_2": text.seq.new_zeros((b, _HV15_GLYPH_TOKENS, cfg.text_embed_2_dim)),
        "encoder_attention_mask_2": text.mask.new_zeros((b, _HV15_GLYPH_TOKENS)),
        "image_embeds": text.seq.new_zeros((b, _HV15_IMAGE_TOKENS, cfg.image_embed_dim)),
        "return_dict": False,
    }


# FFN boundary: the image stream's ``ff`` (the text stream's ``ff_context`` stays in the block);
# attention boundary: ``attn``. The text token refiner is not declared (see hunyuanvideo.py).
HUNYUANVIDEO15 = register_family(
    FamilyAdapter(
        name="hunyuanvideo15",
        model_class="HunyuanVideo15Transformer3DModel",
        flow_shift=FlowShift(5.0, source="HunyuanVideo-1.5 480p T2V: shift 5.0 (diffusers "
                             "scripts/convert_hunyuan_video1_5_to_diffusers.py; 9.0 at 720p)"),
        block_lists=(BlockList("blocks", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),),
        text=lambda cfg: TextSpec(cfg["text_embed_dim"]),
        make_inputs=_make_inputs,
        tiny_config={
            "in_channels": 65,  # 2 * 32 latent channels + 1 mask channel, as the real model
            "out_channels": 32,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "num_layers": 8,
            "num_refiner_layers": 1,
            "mlp_ratio": 2.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "text_embed_dim": 32,
            "text_embed_2_dim": 16,
            "image_embed_dim": 16,
            "rope_axes_dim": (4, 6, 6),
        },
        latent_channels=32,
        video_latents=True,
        frames=FrameRule(4, "AutoencoderKLHunyuanVideo15", source="AutoencoderKLHunyuanVideo15 temporal_compression_ratio 4"),
        notes=(
            "text = Qwen2.5-VL hidden states + mask; the ByT5 glyph stream and the SigLIP image stream "
            "are passed empty (zeros, all-false mask, one token each) as the text-to-video pipeline "
            "does for prompts without quoted text",
            "the condition latents and mask channels are zeros (text-to-video); image-to-video "
            "conditioning and MeanFlow (timestep_r) variants are not built here",
            "the ByT5 projection's 2048 hidden width is fixed by diffusers, so the tiny preset has ~4.5M "
            "parameters (almost all in context_embedder_2)",
            "the text token refiner (context_embedder.token_refiner) is called directly by the text "
            "embedder: never checkpointed, not a declared list",
        ),
    )
)
