"""Wan VACE (``WanVACETransformer3DModel``): the VACE hint list, then the Wan DiT list. Per-block only.

Source: ``diffusers/models/transformers/transformer_wan_vace.py`` and
``pipelines/wan/pipeline_wan_vace.py`` (diffusers 0.42.1).

Under gradient checkpointing the loop first calls every VACE block as ``block(hidden, encoder,
control, timestep_proj, rotary_emb)``; it returns ``(hint, control)`` and the loop feeds
``control`` to the next VACE block (a carry of ``((1, 2),)``) but also keeps EVERY block's
``hint``. Then it calls the Wan blocks as ``block(hidden, encoder, timestep_proj, rotary_emb)``,
returning the hidden state alone (:data:`SINGLE`), and after each block listed in
``config.vace_layers`` it adds that layer's hint: ``hidden = hidden + hint * scale``.

Neither list can run as whole-block segments, so the family is declared per-block only
(``segmented=False``; interval and stride are ignored with a warning):

* VACE list: a segment returns only its last block's ``(hint, control)`` and the runner passes
  that through for the segment's other blocks, so the loop would collect the last hint in place of
  every earlier one. The runner cannot detect this (the carried ``control`` matches), so the
  values would be silently wrong; a carry map cannot express "every block's output is consumed".
* Wan list: the hint added after a ``vace_layers`` block changes the next block's input (the
  runner would detect it and fall back for the list). Segments that end at each hinted block would
  be exact, but a plan cannot express such boundaries.

Inputs: as the pipeline without a control video or mask (``video`` zeros, ``mask`` ones), the
control latents are ``[inactive, reactive]`` latents of a blank video plus the 64 (8x8 VAE
stride) mask channels of ones. The pipeline VAE-encodes the blank video; the adapter has no VAE
and uses zero latents for it. Text embeddings are zeroed past each prompt as in Wan; the timestep
is ``sigma * 1000``.
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

# VACE blocks: block(hidden, encoder, control, timestep_proj, rotary_emb) -> (hint, control)
_VACE = Carry(((1, 2),))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, c, f, h, w = latents.shape
    mask_channels = model.config.vace_in_channels - 2 * c
    control = torch.cat([latents.new_zeros(b, 2 * c, f, h, w), latents.new_ones(b, mask_channels, f, h, w)], dim=1)
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq * text.mask.unsqueeze(-1).to(text.seq.dtype),
        "timestep": sigmas.to(latents.dtype) * 1000,  # the Wan pipelines pass scheduler timesteps
        "control_hidden_states": control,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return output[0]


WANVACE = register_family(
    FamilyAdapter(
        name="wanvace",
        model_class="WanVACETransformer3DModel",
        block_lists=(
            BlockList("vace", "vace_blocks", _VACE, ffn="ffn", attention="attn1"),
            BlockList("blocks", "blocks", SINGLE, ffn="ffn", attention="attn1"),
        ),
        text=lambda cfg: TextSpec(cfg["text_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
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
        video_latents=True,
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
