"""LTX-Video 0.9 (``LTXVideoTransformer3DModel``): one list of DiT blocks over video tokens.

Source read: ``diffusers/models/transformers/transformer_ltx.py`` (diffusers 0.42.1), with
``pipelines/ltx/pipeline_ltx.py`` for how the transformer is called. The latents go in as a token
sequence ``(B, F*H*W, C)`` (patchified as the pipeline's ``_pack_latents``) and come back in the
same layout. LTX-2 has its own file (``ltx2video.py``).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import LTXV, TextEncoders
from ..frames import LTX_VIDEO_VAE
from ..lazy import torch
from ..packing import pack_video, read_packed_video
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# pipeline_ltx.py: rope_interpolation_scale = (VAE temporal ratio / frame_rate, spatial, spatial)
_LTX_VAE_TEMPORAL, _LTX_VAE_SPATIAL, _LTX_FRAME_RATE = 8, 32, 25


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    p, pt = model.config.patch_size, model.config.patch_size_t
    _, _, f, h, w = latents.shape
    return {
        "hidden_states": pack_video(latents, p, pt),
        "encoder_hidden_states": text.seq,
        "encoder_attention_mask": text.mask,
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the pipeline passes scheduler timesteps
        "num_frames": f // pt,
        "height": h // p,
        "width": w // p,
        "rope_interpolation_scale": (_LTX_VAE_TEMPORAL / _LTX_FRAME_RATE, _LTX_VAE_SPATIAL, _LTX_VAE_SPATIAL),
        "return_dict": False,
    }


# block(hidden, encoder, temb, rope, encoder_mask) -> hidden: the plain single-tensor carry. The FFN
# ``ff`` is one module on one tensor; the documents say attention offload is unsupported for
# LTX-Video 0.9, so no attention boundary is declared.
LTXVIDEO = register_family(
    FamilyAdapter(
        name="ltxvideo",
        model_class="LTXVideoTransformer3DModel",
        flow_shift=FlowShift(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                             shift_terminal=0.1,
                             mu_rule="ltx.pipeline_ltx:calculate_shift",
                             source="Lightricks/LTX-Video 0.9.1 scheduler (diffusers "
                             "scripts/convert_ltx_to_diffusers.py; 0.9.5 and 0.9.7: static 1.0)"),
        block_lists=(BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention=None),),
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
            "cross_attention_dim": 32,  # = inner dim: the caption projection's width
            "num_layers": 8,
            "caption_channels": 32,
        },
        latent_channels=128,
        comfy_latents=LTXV,
        text_encoders=TextEncoders("t5", max_length=128),
        video_latents=True,
        frames=LTX_VIDEO_VAE,
        notes=(
            "attention offload unsupported for LTX-Video 0.9 (documents): no attention boundary declared",
            "text = T5 hidden states + mask; RoPE scaled as the pipeline does at 25 fps",
            "image/video-conditioned pipelines (per-token timesteps, video_coords) are not built here",
        ),
    )
)
