"""ACE-Step 1.5 (``AceStepTransformer1DModel``): one list of DiT blocks over a 1-D audio latent
sequence. Per-block checkpointing only (see the notes).

Source: ``diffusers/models/transformers/ace_step_transformer.py`` and
``diffusers/pipelines/ace_step/pipeline_ace_step.py`` (diffusers 0.42).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # The engine hands image-shaped (B, C, H, W) latents; this 1-D model takes (B, T, C).
    b, c, h, w = latents.shape
    hidden = latents.flatten(2).transpose(1, 2)  # (B, H*W, C): H*W is the time axis (row-major)
    # context_latents = cat(src_latents, chunk_mask) as in text-to-music mode: the chunk mask is all
    # ones (generate everywhere); src_latents there is the condition encoder's learned silence_latent,
    # which is not part of the transformer, so zeros stand in for it
    context_dim = model.config.in_channels - model.config.audio_acoustic_hidden_dim
    half = context_dim // 2
    context = torch.cat([hidden.new_zeros(b, h * w, half),  # stand-in for the silence latent
                         hidden.new_ones(b, h * w, context_dim - half)], dim=-1)  # chunk mask
    # sigma in [0, 1] (the model scales it by 1000 itself), timestep_r = timestep (standard, not
    # mean-flow); the model predicts the flow velocity noise - x0. encoder_hidden_states is the
    # condition encoder's packed output; the DiT takes no text mask (the pipeline passes none).
    t = sigmas.to(latents.dtype)
    return {
        "hidden_states": hidden,
        "timestep": t,
        "timestep_r": t,
        "encoder_hidden_states": text.seq.to(latents.dtype),
        "context_latents": context,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return output[0].transpose(1, 2).reshape(latents.shape)


# block(hidden, (cos, sin), timestep_proj, layer_attn_mask, encoder_hidden_states, None) -> hidden.
# layer_attn_mask alternates by model.layer_types between the banded sliding-window mask and None
# (full attention), so a segment spanning both would run a block with the wrong mask (the runner
# would detect it and fall back): segmented=False. Under a flash-attention backend the loop passes
# None to every layer and applies the window inside the attention, but the adapter cannot know the
# backend in advance. FFN: the SwiGLU mlp; attention: self_attn (cross_attn stays in the block).
ACESTEP = register_family(
    FamilyAdapter(
        name="acestep",
        model_class="AceStepTransformer1DModel",
        block_lists=(BlockList("blocks", "layers", SINGLE, ffn="mlp", attention="self_attn"),),
        text=lambda cfg: TextSpec(cfg.get("encoder_hidden_size") or cfg["hidden_size"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "in_channels": 192,
            "audio_acoustic_hidden_dim": 64,
            "patch_size": 2,
            "sliding_window": 8,
            "encoder_hidden_size": 24,
        },
        latent_channels=64,
        aspect_buckets=False,  # the latents are a 1-D audio sequence (H*W flattened): no aspect ratio
        segmented=False,
        notes=(
            "per-block only: the loop passes the sliding-window mask to sliding layers and None to "
            "full-attention layers (alternating), which a carry map cannot express",
            "1-D model: image-shaped (B, C, H, W) latents are flattened to a (B, H*W, C) time axis and "
            "reshaped back; C = 64 acoustic channels of the ACE-Step audio VAE",
            "context_latents = cat(zeros standing in for the condition encoder's silence_latent, "
            "an all-ones chunk mask): text-to-music mode",
        ),
    )
)
