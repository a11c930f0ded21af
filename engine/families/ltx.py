"""LTX-Video 0.9 (``LTXVideoTransformer3DModel``) and LTX-2 (``LTX2VideoTransformer3DModel``).

Source read: ``diffusers/models/transformers/transformer_ltx.py`` and ``transformer_ltx2.py``
(diffusers 0.42.1), with ``pipelines/ltx/pipeline_ltx.py`` and ``pipelines/ltx2/pipeline_ltx2.py``
for how the transformer is called. Both take the latents as a token sequence ``(B, F*H*W, C)``
(patchified as the pipelines' ``_pack_latents``) and return it in the same layout.

LTX-Video 0.9: one list ``transformer_blocks``, called as ``block(hidden, encoder, temb, rope,
encoder_mask)`` and returning the hidden state alone (plain single-tensor carry). The documents
say attention offload is unsupported for LTX-Video 0.9, so no attention boundary is declared; the
FFN ``ff`` is one module on one tensor.

LTX-2: one list ``transformer_blocks`` of audio-video blocks, called with 26 positional arguments
``block(hidden, audio_hidden, encoder, audio_encoder, temb, temb_audio, ..., masks, ...,
perturbation_mask, all_perturbed)`` and returning ``(hidden, audio_hidden)``, so the carry is
``((0, 0), (1, 1))``. The loop changes two arguments per block only for spatio-temporal guidance
(STG: ``perturbation_mask`` / ``all_perturbed`` set on the chosen blocks), an inference-time
guidance the training inputs never request; every other argument (the masks included) is built
once before the loop. Were STG passed, the runner would detect the change and fall back to
per-block. FFN boundary: the video stream's ``ff`` (the audio stream's ``audio_ff`` stays in the
block); attention boundary: the video self-attention ``attn1``. Training reads the video
prediction only, so the default LoRA targets the attentions that write into the video stream.
"""

from __future__ import annotations

import torch

from .base import (
    SINGLE,
    BlockList,
    Carry,
    FamilyAdapter,
    TextBatch,
    TextSpec,
    register_family,
)


def pack_video(latents: torch.Tensor, p: int, pt: int) -> torch.Tensor:
    """``(B, C, F, H, W)`` latents to ``(B, F/pt * H/p * W/p, C * pt * p * p)`` tokens
    (``LTXPipeline._pack_latents``)."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_video(tokens: torch.Tensor, shape: torch.Size, p: int, pt: int) -> torch.Tensor:
    """Inverse of :func:`pack_video` (``LTXPipeline._unpack_latents``) for latents of ``shape``."""
    b, _, f, h, w = shape
    x = tokens.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


# pipeline_ltx.py: rope_interpolation_scale = (VAE temporal ratio / frame_rate, spatial, spatial)
_LTX_VAE_TEMPORAL, _LTX_VAE_SPATIAL, _LTX_FRAME_RATE = 8, 32, 25


def _ltx_make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    p, pt = model.config.patch_size, model.config.patch_size_t
    _, _, f, h, w = latents.shape
    return {
        "hidden_states": pack_video(latents, p, pt),
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "timestep": sigmas.to(latents.dtype) * 1000,  # the pipeline passes scheduler timesteps
        "num_frames": f // pt,
        "height": h // p,
        "width": w // p,
        "rope_interpolation_scale": (_LTX_VAE_TEMPORAL / _LTX_FRAME_RATE, _LTX_VAE_SPATIAL, _LTX_VAE_SPATIAL),
        "return_dict": False,
    }


def _ltx_read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return unpack_video(output[0], latents.shape, model.config.patch_size, model.config.patch_size_t)


LTXVIDEO = register_family(
    FamilyAdapter(
        name="ltxvideo",
        model_class="LTXVideoTransformer3DModel",
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention=None),),
        text=lambda cfg: TextSpec(cfg["caption_channels"]),
        make_inputs=_ltx_make_inputs,
        read_output=_ltx_read_output,
        tiny_config={
            "in_channels": 128,
            "out_channels": 128,
            "patch_size": 1,
            "patch_size_t": 1,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "cross_attention_dim": 32,  # = inner dim: the caption projection's width
            "num_layers": 8,
            "caption_channels": 32,
        },
        latent_channels=128,
        video_latents=True,
        notes=(
            "attention offload unsupported for LTX-Video 0.9 (documents): no attention boundary declared",
            "text = T5 hidden states + mask; RoPE scaled as the pipeline does at 25 fps",
            "image/video-conditioned pipelines (per-token timesteps, video_coords) are not built here",
        ),
    )
)


# pipeline_ltx2.py defaults: frame_rate 24; audio VAE 16 kHz, hop 160, 4x temporal compression
_LTX2_FPS, _LTX2_VAE_TEMPORAL = 24.0, 8
_LTX2_AUDIO_LATENTS_PER_SECOND = 16000 / 160 / 4


# the attentions whose output is added to the video stream (see the notes)
_LTX2_VIDEO_LORA_TARGETS = tuple(f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_to_video_attn")
                                 for proj in ("to_q", "to_k", "to_v", "to_out.0"))


def _ltx2_audio_frames(video_latent_frames: int) -> int:
    """Audio latent length of a clip, as ``LTX2Pipeline`` derives it from the clip duration."""
    duration = ((video_latent_frames - 1) * _LTX2_VAE_TEMPORAL + 1) / _LTX2_FPS
    return max(1, round(duration * _LTX2_AUDIO_LATENTS_PER_SECOND))


def _ltx2_make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    cfg = model.config
    p, pt = cfg.patch_size, cfg.patch_size_t
    b, _, f, h, w = latents.shape
    timestep = sigmas.to(latents.dtype) * 1000  # the pipeline passes scheduler timesteps
    # The model is audio-video; training on video alone, the audio stream is zero audio latents
    # (a stand-in for silence) noised at the same sigma, and only the video prediction is read.
    frames = _ltx2_audio_frames(f)
    audio_noise = torch.randn(b, frames, cfg.audio_in_channels, device=latents.device, dtype=latents.dtype)
    return {
        "hidden_states": pack_video(latents, p, pt),
        "audio_hidden_states": sigmas.to(latents.dtype).view(b, 1, 1) * audio_noise,
        # text.seq stands for the text connectors' output, fed to both streams as the pipeline does
        "encoder_hidden_states": text.seq,
        "audio_encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "audio_encoder_attention_mask": text.mask,
        "timestep": timestep,
        "sigma": timestep,  # the pipeline passes sigma=timestep (LTX-2.3 prompt modulation)
        "num_frames": f // pt,
        "height": h // p,
        "width": w // p,
        "fps": _LTX2_FPS,
        "audio_num_frames": frames,
        "return_dict": False,
    }


LTX2VIDEO = register_family(
    FamilyAdapter(
        name="ltx2video",
        model_class="LTX2VideoTransformer3DModel",
        block_lists=(
            BlockList("blocks", "transformer_blocks", Carry(((0, 0), (1, 1))), ffn="ff", attention="attn1"),
        ),
        text=lambda cfg: TextSpec(cfg["caption_channels"]),
        make_inputs=_ltx2_make_inputs,
        read_output=_ltx_read_output,
        tiny_config={
            "in_channels": 128,
            "out_channels": 128,
            "patch_size": 1,
            "patch_size_t": 1,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "cross_attention_dim": 32,  # = video inner dim
            "audio_in_channels": 16,
            "audio_out_channels": 16,
            "audio_num_attention_heads": 2,
            "audio_attention_head_dim": 8,
            "audio_cross_attention_dim": 16,  # = audio inner dim
            "num_layers": 8,
            "caption_channels": 32,
        },
        latent_channels=128,
        video_latents=True,
        lora_targets=_LTX2_VIDEO_LORA_TARGETS,
        notes=(
            "LoRA targets the attentions that write into the video stream (attn1, attn2, "
            "audio_to_video_attn); the audio-stream attentions (audio_attn1, audio_attn2, "
            "video_to_audio_attn) are left out: with no audio loss they would train only through "
            "cross-modal leakage, and the last block's video_to_audio_attn gets no gradient at all",
            "video-only training: the audio stream is zero audio latents (a stand-in for silence) "
            "noised at the batch's sigma, with the pipeline's audio length for the clip duration at "
            "24 fps; the audio prediction is not trained",
            "text.seq stands for the text connectors' output (LTX2TextConnectors runs outside the "
            "transformer) and is fed to the video and the audio stream",
            "spatio-temporal guidance (per-block perturbation masks) is inference-only; if passed, "
            "the runner detects the per-block change and falls back to per-block",
        ),
    )
)
