"""HunyuanVideo (``HunyuanVideoTransformer3DModel``) and HunyuanVideo 1.5
(``HunyuanVideo15Transformer3DModel``).

Source read: ``diffusers/models/transformers/transformer_hunyuan_video.py`` and
``transformer_hunyuan_video15.py`` (diffusers 0.42.1), with ``pipelines/hunyuan_video`` and
``pipelines/hunyuan_video1_5`` for how the transformer is called.

HunyuanVideo has a dual-stream list ``transformer_blocks`` and a single-stream list
``single_transformer_blocks``. The loop calls both as ``block(hidden, encoder, temb,
attention_mask, rotary_emb, token_replace_emb, first_frame_num_tokens)`` and both return
``(hidden, encoder)`` (the single-stream block concatenates and splits the streams itself), so
both carry ``((0, 0), (1, 1))``; every other argument is built once before the loops.
HunyuanVideo 1.5 has the dual-stream list only, called as ``block(hidden, encoder, temb,
encoder_attention_mask, rotary_emb)``, returning ``(hidden, encoder)``: the same carry.

The text token refiner (``context_embedder.token_refiner.refiner_blocks``, in both models) is
called directly inside the text embedder, never through the checkpoint function; it is not a
top-level attribute, so it is not declared as a block list (nothing can schedule it anyway).

FFN boundaries: the dual-stream block's image-stream ``ff`` (the text stream's ``ff_context``
stays in the block); the single-stream block's MLP branch ``act_mlp(proj_mlp(x))`` as in Flux
(the fused ``proj_out`` stays outside). Attention boundary: ``attn`` in every block.
"""

from __future__ import annotations

import torch

from .base import BlockList, Carry, FamilyAdapter, TextBatch, TextSpec, register_family

# block(hidden, encoder, temb, mask, rope, ...) -> (hidden, encoder)
_CARRY = Carry(((0, 0), (1, 1)))

# HunyuanVideo 1.5 always takes ByT5 glyph embeddings and SigLIP image embeddings. For text-to-video
# without quoted glyph text the pipeline passes them as zeros with an all-false mask; masked
# tokens are masked both as queries and as keys, so their number does not change the prediction.
# One token each instead of the pipeline's 256 / 729 keeps the sequence short.
_HV15_GLYPH_TOKENS = 1
_HV15_IMAGE_TOKENS = 1


def _hv_make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b = latents.shape[0]
    inputs = {
        "hidden_states": latents,
        "timestep": sigmas.to(latents.dtype) * 1000,  # the pipeline passes scheduler timesteps
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "pooled_projections": text.pooled,
        "return_dict": False,
    }
    if model.config.guidance_embeds:  # guidance-distilled T2V: guidance 1.0, scaled as the pipeline does
        inputs["guidance"] = torch.full((b,), 1000.0, device=latents.device, dtype=latents.dtype)
    return inputs


def _hv15_make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, c = latents.shape[:2]
    cfg = model.config
    # text-to-video: [latents, zero condition latents, zero condition mask] (in_channels = 2C + 1)
    extra = latents.new_zeros((b, cfg.in_channels - c, *latents.shape[2:]))
    return {
        "hidden_states": torch.cat([latents, extra], dim=1),
        "timestep": sigmas.to(latents.dtype) * 1000,
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "encoder_hidden_states_2": text.seq.new_zeros((b, _HV15_GLYPH_TOKENS, cfg.text_embed_2_dim)),
        "encoder_attention_mask_2": text.mask.new_zeros((b, _HV15_GLYPH_TOKENS)),
        "image_embeds": text.seq.new_zeros((b, _HV15_IMAGE_TOKENS, cfg.image_embed_dim)),
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return output[0]


HUNYUANVIDEO = register_family(
    FamilyAdapter(
        name="hunyuanvideo",
        model_class="HunyuanVideoTransformer3DModel",
        block_lists=(
            BlockList("double", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", _CARRY, ffn=("proj_mlp", "act_mlp"),
                      attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["text_embed_dim"], cfg["pooled_projection_dim"]),
        make_inputs=_hv_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "num_layers": 4,
            "num_single_layers": 4,
            "num_refiner_layers": 1,
            "mlp_ratio": 2.0,
            "patch_size": 2,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 32,
            "pooled_projection_dim": 16,
            "rope_axes_dim": (4, 6, 6),
        },
        latent_channels=16,
        video_latents=True,
        notes=(
            "text = LLaVA-Llama hidden states (encoder_hidden_states + mask) and the CLIP pooled embedding",
            "guidance-distilled checkpoints (guidance_embeds): training passes guidance 1.0 as LoRA "
            "trainers commonly do, as 1000 because the pipeline multiplies the scale by 1000 (its "
            "inference default is 6.0)",
            "the text token refiner (context_embedder.token_refiner) is called directly by the text "
            "embedder: never checkpointed, not a declared list",
            "image-to-video variants (image_condition_type latent_concat / token_replace) are not built here",
        ),
    )
)

HUNYUANVIDEO15 = register_family(
    FamilyAdapter(
        name="hunyuanvideo15",
        model_class="HunyuanVideo15Transformer3DModel",
        block_lists=(BlockList("blocks", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),),
        text=lambda cfg: TextSpec(cfg["text_embed_dim"]),
        make_inputs=_hv15_make_inputs,
        read_output=_read_output,
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
