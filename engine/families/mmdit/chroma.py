"""Chroma (``ChromaTransformer2DModel``): a double-stream list, then a single-stream list; per-block only.

Source: ``diffusers/models/transformers/transformer_chroma.py`` (forward loop) and
``diffusers/pipelines/chroma/pipeline_chroma.py`` (how the pipeline calls the transformer).
Conventions: 16-channel Flux VAE latents, 2x2-packed; ``img_ids (h, w, 3)`` as in Flux, zero
``txt_ids``; the timestep is sigma (the model multiplies by 1000); no pooled embedding.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..conditioning import FLUX, TextEncoders
from ..lazy import torch
from ..packing import image_ids, pack_2x2, read_packed_2x2
from ..registry import register_family

# double: block(hidden, encoder, temb_i, rope, attention_mask) -> (encoder, hidden); single:
# block(joint, temb_i, rope) -> joint. temb_i differs per block: the loop slices the approximator's
# output (cat of the image and text modulation slices for double block i, pooled_temb[:, 3i:3i+3]
# for single block i), so a segment would run all its blocks with the first one's modulation:
# segmented=False (the documents list Chroma in the sweep "with notes", not among the segmented
# whole-block families). Engine change that would allow segments: a per-list hook
# next_args(model, block_index, args, kwargs) rebuilding block i+1's non-carried arguments inside
# the region, plus a value (not identity) check of those arguments on the passed-through blocks.
_DOUBLE = Carry(((0, 1), (1, 0)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # No text mask: the loop's checkpointed call of the single blocks drops attention_mask (and
    # joint_attention_kwargs) while its plain call passes it, so a padded prompt would be masked in the
    # double blocks only and the function would change with the schedule; the pipeline also builds the
    # mask in the latents' float dtype, which SDPA adds to the scores instead of masking (diffusers
    # issue #12116). Instead the padding columns the whole batch shares are dropped, keeping one
    # padding token after the longest prompt: for one prompt (or prompts of equal length) that equals
    # Chroma's "mask all padding but the first" rule exactly (text RoPE ids are all zero); shorter
    # prompts of a mixed batch still see the batch's extra padding tokens.
    _, _, h, w = latents.shape
    length = min(text.seq.shape[1], int(text.mask.sum(dim=1).max()) + 1)  # + the first padding token
    return {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": text.seq[:, :length],
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "img_ids": image_ids(h, w, latents.device, latents.dtype),
        "txt_ids": torch.zeros(length, 3, device=latents.device, dtype=latents.dtype),
        "return_dict": False,
    }


# FFN boundary (the documents list Chroma among the FFN-split families): the double blocks' ff on
# one tensor; the single blocks' MLP branch act_mlp(proj_mlp(x)), run in parallel with attention as
# in Flux (the fused proj_out stays outside).
CHROMA = register_family(
    FamilyAdapter(
        name="chroma",
        model_class="ChromaTransformer2DModel",
        flow_shift=FlowShift(3.0, use_dynamic_shifting=True, mu_rule="chroma.pipeline_chroma:calculate_shift",
                             source="lodestones/Chroma scheduler config, as ai-toolkit declares it"),
        block_lists=(
            BlockList("double", "transformer_blocks", _DOUBLE, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", SINGLE, ffn=("proj_mlp", "act_mlp"),
                      attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"]),
        make_inputs=_make_inputs,
        read_output=read_packed_2x2,
        tiny_config={
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 8,
            "num_single_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": (4, 6, 6),  # sums to the head dim
            "approximator_num_channels": 16,
            "approximator_hidden_dim": 32,
            "approximator_layers": 2,
        },
        latent_channels=16,
        patch=2,  # make_inputs packs 2x2 latents (config patch_size is 1)
        comfy_latents=FLUX,
        text_encoders=TextEncoders("t5", max_length=512),
        segmented=False,
        notes=(
            "per-block only: the loop passes every block its own modulation slice (temb), which a carry "
            "map cannot express; interval and stride are ignored with a warning",
            "single-stream blocks: the FFN region is the MLP branch act_mlp(proj_mlp(x)); the fused "
            "output projection stays outside it",
            "no text mask is passed (the checkpointed single-block call drops it); padding columns past "
            "the longest prompt's first padding token are dropped instead",
        ),
    )
)
