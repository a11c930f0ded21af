"""LTX-2 (``LTX2VideoTransformer3DModel``): one list of audio-video DiT blocks, trained on video.

Source read: ``diffusers/models/transformers/transformer_ltx2.py`` (diffusers 0.42.1), with
``pipelines/ltx2/pipeline_ltx2.py`` for how the transformer is called. The video latents go in as
a token sequence ``(B, F*H*W, C)`` (patchified as LTX-Video's, :func:`..packing.pack_video`) and
come back in the same layout; only the video prediction is read.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..frames import FrameRule
from ..lazy import torch
from ..packing import pack_video, read_packed_video
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# block(hidden, audio_hidden, encoder, audio_encoder, temb, temb_audio, ..., masks, ...,
# perturbation_mask, all_perturbed) -> (hidden, audio_hidden): 26 positional arguments. The loop
# changes two of them per block only for spatio-temporal guidance (STG, inference-only, see the
# notes); every other argument (the masks included) is built once before the loop.
_CARRY = Carry(((0, 0), (1, 1)))


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


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    cfg = model.config
    p, pt = cfg.patch_size, cfg.patch_size_t
    b, _, f, h, w = latents.shape
    timestep = scheduler_timesteps(sigmas, latents.dtype)  # the pipeline passes scheduler timesteps
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


# FFN boundary: the video stream's ``ff`` (the audio stream's ``audio_ff`` stays in the block);
# attention boundary: the video self-attention ``attn1``.
LTX2VIDEO = register_family(
    FamilyAdapter(
        name="ltx2video",
        model_class="LTX2VideoTransformer3DModel",
        flow_shift=FlowShift(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                             shift_terminal=0.1,
                             mu_rule="ltx2.pipeline_ltx2:calculate_shift",
                             source="Lightricks/LTX-2 scheduler config, as ai-toolkit declares it"),
        block_lists=(BlockList("blocks", "transformer_blocks", _CARRY, ffn="ff", attention="attn1"),),
        text=lambda cfg: TextSpec(cfg["caption_channels"]),
        make_inputs=_make_inputs,
        read_output=read_packed_video,
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
        frames=FrameRule(8, "AutoencoderKLLTX2Video", source="AutoencoderKLLTX2Video temporal_compression_ratio 8"),
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
