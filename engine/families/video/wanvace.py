"""Wan VACE (``WanVACETransformer3DModel``): the VACE hint list, then the Wan DiT list. Per-block only.

Source: ``diffusers/models/transformers/transformer_wan_vace.py`` and
``pipelines/wan/pipeline_wan_vace.py`` (diffusers 0.42.1). Text embeddings are zeroed past each
prompt as in Wan; the timestep is the scheduler timestep.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import WAN21, TextEncoders
from ..frames import WAN_VAE
from ..lazy import torch
from ..position_tables import wan_rope
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# Under gradient checkpointing the loop first calls every VACE block as block(hidden, encoder,
# control, timestep_proj, rotary_emb) -> (hint, control), feeding control to the next VACE block
# but keeping EVERY block's hint; then the Wan blocks as block(hidden, encoder, timestep_proj,
# rotary_emb) -> hidden, adding after each block of config.vace_layers its hint (hidden = hidden +
# hint * scale). Neither list can run as whole-block segments (segmented=False):
# - VACE list: a segment returns only its last block's (hint, control) and the runner passes that
#   through for the segment's other blocks, so the loop would collect the last hint in place of
#   every earlier one. The runner cannot detect this (the carried control matches): silently wrong
#   values; a carry map cannot express "every block's output is consumed".
# - Wan list: the hint added after a vace_layers block changes the next block's input (the runner
#   would detect it and fall back). Segments ending at each hinted block would be exact, but a plan
#   cannot express such boundaries.
_VACE = Carry(((1, 2),))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # as the pipeline without a control video or mask (video zeros, mask ones): the control latents
    # are [inactive, reactive] latents of a blank video plus the 64 (8x8 VAE stride) mask channels of
    # ones; the pipeline VAE-encodes the blank video, the adapter (no VAE) uses zero latents for it
    b, c, f, h, w = latents.shape
    mask_channels = model.config.vace_in_channels - 2 * c
    control = torch.cat([latents.new_zeros(b, 2 * c, f, h, w), latents.new_ones(b, mask_channels, f, h, w)], dim=1)
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq * text.mask.unsqueeze(-1).to(text.seq.dtype),
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # the Wan pipelines pass scheduler timesteps
        "control_hidden_states": control,
        "return_dict": False,
    }


WANVACE = register_family(
    FamilyAdapter(
        name="wanvace",
        model_class="WanVACETransformer3DModel",
        flow_shift=FlowShift(3.0, source="Wan VACE Diffusers: UniPCMultistepScheduler flow_shift 3.0 (diffusers "
                             "scripts/convert_wan_to_diffusers.py)"),
        block_lists=(
            BlockList("vace", "vace_blocks", _VACE, ffn="ffn", attention="attn1"),
            BlockList("blocks", "blocks", SINGLE, ffn="ffn", attention="attn1"),
        ),
        text=lambda cfg: TextSpec(cfg["text_dim"]),
        make_inputs=_make_inputs,
        tiny_config={
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 32,
            "freq_dim": 32,
            "ffn_dim": 32,
            "num_layers": 8,
            "rope_max_seq_len": 32,
            "vace_layers": (0, 2, 4, 6),
            "vace_in_channels": 96,  # 2 x 16 latent channels + 64 mask channels, as the released models
        },
        latent_channels=16,
        limits=wan_rope,
        comfy_latents=WAN21,
        text_encoders=TextEncoders("t5", max_length=512),  # UMT5-XXL
        video_latents=True,
        frames=WAN_VAE,
        segmented=False,
        notes=(
            "per-block only: every VACE block's hint is consumed by the loop (a segment would pass its "
            "last hint through for all of them, undetected), and the Wan loop adds a hint after each "
            "vace_layers block (a state change between blocks)",
            "no control video: control latents are zeros (the pipeline VAE-encodes a blank video) plus "
            "mask channels of ones; reference images are not built",
            "attention boundary is the self-attention attn1; the cross-attention attn2 stays in the block",
        ),
    )
)
