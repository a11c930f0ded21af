"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): a dual-stream list, then a single-stream list.

Source read: ``diffusers/models/transformers/transformer_hunyuan_video.py`` (diffusers 0.42.1),
with ``pipelines/hunyuan_video`` for how the transformer is called. HunyuanVideo 1.5 has its own
file (``hunyuanvideo15.py``).
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import HUNYUAN_VIDEO
from ..frames import HUNYUAN_VIDEO_VAE
from ..lazy import torch
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# Both lists: block(hidden, encoder, temb, attention_mask, rotary_emb, token_replace_emb,
# first_frame_num_tokens) -> (hidden, encoder) (the single-stream block concatenates and splits the
# streams itself); every other argument is built once before the loops.
_CARRY = Carry(((0, 0), (1, 1)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b = latents.shape[0]
    inputs = {
        "hidden_states": latents,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the pipeline passes scheduler timesteps
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "pooled_projections": text.pooled,
        "return_dict": False,
    }
    if model.config.guidance_embeds:  # guidance-distilled T2V: guidance 1.0, scaled as the pipeline does
        inputs["guidance"] = torch.full((b,), 1000.0, device=latents.device, dtype=latents.dtype)
    return inputs


# FFN boundaries: the dual-stream block's image-stream ``ff`` (the text stream's ``ff_context`` stays
# in the block); the single-stream block's MLP branch ``act_mlp(proj_mlp(x))`` as in Flux (the fused
# ``proj_out`` stays outside). Attention boundary: ``attn`` in every block. The text token refiner
# (``context_embedder.token_refiner.refiner_blocks``) is not a top-level attribute and is never
# routed through the checkpoint function, so it is not declared (nothing could schedule it).
HUNYUANVIDEO = register_family(
    FamilyAdapter(
        name="hunyuanvideo",
        model_class="HunyuanVideoTransformer3DModel",
        flow_shift=FlowShift(7.0, source="hunyuanvideo-community/HunyuanVideo: shift 7.0 (diffusers "
                             "scripts/convert_hunyuan_video_to_diffusers.py --flow_shift)"),
        guidance_input=True,
        block_lists=(
            BlockList("double", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", _CARRY, ffn=("proj_mlp", "act_mlp"),
                      attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["text_embed_dim"], cfg["pooled_projection_dim"]),
        make_inputs=_make_inputs,
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
        comfy_latents=HUNYUAN_VIDEO,
        video_latents=True,
        frames=HUNYUAN_VIDEO_VAE,
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
