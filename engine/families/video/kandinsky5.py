"""Kandinsky 5 Image / Video (``Kandinsky5Transformer3DModel``): a text encoder list, then a visual list.

Source: ``diffusers/models/transformers/transformer_kandinsky.py`` and
``pipelines/kandinsky5/pipeline_kandinsky_t2i.py`` / ``pipeline_kandinsky.py`` (diffusers 0.42.1).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..frames import HUNYUAN_VIDEO_VAE
from ..lazy import torch
from ..position_tables import kandinsky5_rope
from ..registry import register_family
from ..timesteps import scheduler_timesteps

_VAE_SCALE = 8  # pixels per latent (Flux VAE for images, HunyuanVideo VAE for videos)


# As the pipelines build them: channels-last latents (B, F, H, W, C) (an image is one frame);
# checkpoints with visual_cond (the video models) take [latents, zero condition latents, zero mask]
# on the channel axis in text-to-video; the timestep is the scheduler timestep; the Qwen embeddings
# are cut to the longest prompt of the batch (no text mask) and the CLIP pooled embedding is added
# to the time embedding; RoPE positions are arange over frames and the 2x2-patched grid, with the
# pipelines' RoPE scale factor. The sparse (nabla) attention of some video checkpoints is not built.
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, f, h, w = latents.shape
    hidden = latents.permute(0, 2, 3, 4, 1)  # (B, F, H, W, C)
    if model.config.visual_cond:  # text-to-video: no condition frames, zero mask
        hidden = torch.cat([hidden, torch.zeros_like(hidden), torch.zeros_like(hidden[..., :1])], dim=-1)
        pixels = (h * _VAE_SCALE, w * _VAE_SCALE)
        scale = (1, 2, 2) if all(480 <= x <= 854 for x in pixels) else (1, 3.16, 3.16)
    else:  # the text-to-image pipeline
        scale = (1.0, 1.0, 1.0)
    length = max(int(text.mask.sum(1).max()), 1)  # padding="longest", as the pipelines tokenize
    _, ph, pw = model.config.patch_size
    device = latents.device
    return {
        "hidden_states": hidden,
        "encoder_hidden_states": text.seq[:, :length],
        "pooled_projections": text.pooled,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the pipelines pass scheduler timesteps
        "visual_rope_pos": [torch.arange(f, device=device), torch.arange(h // ph, device=device),
                            torch.arange(w // pw, device=device)],
        "text_rope_pos": torch.arange(length, device=device),
        "scale_factor": scale,
        "sparse_params": None,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    # (B, F, H, W, C_out) -> (B, C, F, H, W)
    return output[..., : latents.shape[1]].permute(0, 4, 1, 2, 3)


# Under gradient checkpointing the loop calls the text blocks as block(text, time_embed, text_rope)
# and the visual blocks as block(visual, text, time_embed, visual_rope, sparse_params); each returns
# its stream alone. The text stream is final before the first visual block and every other argument
# is the same object for every block of a list, so both lists carry SINGLE. LoRA targets: the class
# zero-initialises every AdaLN modulation projection (Kandinsky5Modulation), so the defaults also
# adapt text_modulation.out_layer and visual_modulation.out_layer (see the notes).
KANDINSKY5 = register_family(
    FamilyAdapter(
        name="kandinsky5",
        model_class="Kandinsky5Transformer3DModel",
        block_lists=(
            BlockList("text", "text_transformer_blocks", SINGLE, ffn="feed_forward", attention="self_attention"),
            BlockList("visual", "visual_transformer_blocks", SINGLE, ffn="feed_forward",
                      attention="self_attention"),
        ),
        text=lambda cfg: TextSpec(cfg["in_text_dim"], cfg["in_text_dim2"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_visual_dim": 16,
            "out_visual_dim": 16,
            "in_text_dim": 32,
            "in_text_dim2": 32,
            "time_dim": 32,
            "patch_size": (1, 2, 2),
            "model_dim": 32,
            "ff_dim": 64,
            "num_text_blocks": 4,
            "num_visual_blocks": 8,
            "axes_dims": (4, 6, 6),  # head_dim = sum = 16: 2 heads
            "visual_cond": False,
        },
        latent_channels=16,
        limits=kandinsky5_rope,
        video_latents=True,
        frames=HUNYUAN_VIDEO_VAE,
        lora_targets=("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer",
                      "text_modulation.out_layer", "visual_modulation.out_layer"),
        notes=(
            "default LoRA also adapts the AdaLN modulation projections: the class zero-initialises them, "
            "so a fresh model's gates are zero and attention-only adapters get no gradient",
            "attention boundary is the self-attention; the visual blocks' cross_attention stays in the block",
            "latents are (B, C, F, H, W) (an image is one frame), passed channels-last as the pipelines do",
            "no text mask in the model: embeddings are cut to the batch's longest prompt (as the pipelines "
            "pad); shorter prompts of a mixed batch attend to padding, as in diffusers",
            "nabla sparse attention (sparse_params) is not built: dense attention",
        ),
    )
)
