"""ACE-Step 1.5 (``AceStepTransformer1DModel``): one list of DiT blocks over a 1-D audio latent
sequence. Per-block checkpointing only.

Source: ``diffusers/models/transformers/ace_step_transformer.py`` and
``diffusers/pipelines/ace_step/pipeline_ace_step.py`` (diffusers 0.42).

The loop calls every block as ``block(hidden, (cos, sin), timestep_proj, layer_attn_mask,
encoder_hidden_states, None)`` and the block returns the hidden state alone. The carry would be
the single-tensor one, but ``layer_attn_mask`` is not the same for every block: layers alternate
between sliding-window attention (``layer_attn_mask`` = the banded mask) and full attention
(``None``) by ``model.layer_types``. A segment runs all its blocks with its first block's
arguments, so a segment spanning a sliding and a full layer would compute wrong values (the runner
would detect it and fall back). The family is therefore declared ``segmented=False``: interval
and stride are ignored with a warning and every block is checkpointed on its own. (Under a
flash-attention backend the loop passes ``None`` to every layer and applies the window inside the
attention, so the arguments would be uniform there; the adapter cannot know the backend in
advance.) The FFN is the block's ``mlp`` (SwiGLU, one module on one tensor), the attention
boundary its ``self_attn``; the cross-attention ``cross_attn`` stays in the block.

Inputs: the engine hands image-shaped latents ``(B, C, H, W)``; this 1-D model takes
``(B, T, C)``, so the adapter flattens ``H * W`` into the time axis (row-major) and
:func:`_read_output` reshapes back. ``C`` is the audio VAE's 64 acoustic channels.
``context_latents`` is ``cat(src_latents, chunk_mask)`` as in the pipeline's text-to-music mode:
the chunk mask is all ones (generate everywhere); the pipeline's ``src_latents`` there is the
condition encoder's learned ``silence_latent``, which is not part of the transformer, so zeros
stand in for it. The timestep is ``sigma`` in [0, 1] (the model scales it by 1000 itself) with
``timestep_r = timestep`` (standard, non mean-flow), and the model predicts the flow velocity
``noise - x0``. ``encoder_hidden_states`` is the condition encoder's packed output; the DiT takes
no text mask (the pipeline passes none).
"""

from __future__ import annotations

import torch

from .base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec, register_family


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, c, h, w = latents.shape
    hidden = latents.flatten(2).transpose(1, 2)  # (B, H*W, C): H*W is the time axis
    context_dim = model.config.in_channels - model.config.audio_acoustic_hidden_dim
    half = context_dim // 2
    context = torch.cat([hidden.new_zeros(b, h * w, half),  # stand-in for the silence latent
                         hidden.new_ones(b, h * w, context_dim - half)], dim=-1)  # chunk mask
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
