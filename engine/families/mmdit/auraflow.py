"""AuraFlow (``AuraFlowTransformer2DModel``): a joint (MMDiT) list, then a single-stream DiT list.

Source: ``diffusers/models/transformers/auraflow_transformer_2d.py`` and
``pipelines/aura_flow/pipeline_aura_flow.py`` (diffusers 0.42.1). As in the pipeline, the T5
embeddings are zeroed past each prompt's length (there is no text mask) and the timestep is
``sigma`` in ``[0, 1]`` (the model multiplies by 1000 itself).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, Carry, FamilyAdapter, TextBatch, TextSpec
from ..conditioning import SDXL, TextEncoders
from ..lazy import torch
from ..position_tables import auraflow_grid
from ..registry import register_family

# Under gradient checkpointing the loop calls the joint blocks as block(hidden, encoder, temb) ->
# (encoder, hidden) and the single blocks as block(combined, temb) -> combined, on the concatenated
# [text, image] sequence; temb is the same tensor for every block of both lists. The checkpointed
# path does not pass attention_kwargs to the blocks (the plain path does); the model only uses them
# for the LoRA scale, which @apply_lora_scale applies outside the loop.
_JOINT = Carry(((0, 1), (1, 0)))


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    return {
        "hidden_states": latents,
        "encoder_hidden_states": text.seq * text.mask.unsqueeze(-1).to(text.seq.dtype),
        "timestep": sigmas.to(latents.dtype),  # the pipeline passes t / 1000
        "return_dict": False,
    }


AURAFLOW = register_family(
    FamilyAdapter(
        name="auraflow",
        model_class="AuraFlowTransformer2DModel",
        block_lists=(
            BlockList("joint", "joint_transformer_blocks", _JOINT, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", SINGLE, ffn="ff", attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["joint_attention_dim"]),
        make_inputs=_make_inputs,
        tiny_config={
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_mmdit_layers": 4,
            "num_single_dit_layers": 4,  # the FFN hidden size is rounded up to 256: keep the preset small
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "caption_projection_dim": 32,  # must equal heads x head_dim (register tokens are concatenated)
            "pos_embed_max_size": 1024,  # a 32 x 32 grid of 2x2 patches: latents up to 64 x 64 (512 px)
        },
        latent_channels=4,  # the SDXL VAE
        limits=auraflow_grid,
        comfy_latents=SDXL,
        text_encoders=TextEncoders("t5", max_length=256),  # Pile-T5 (UMT5)
        notes=(
            "FFN boundary is the image stream's ff (joint) and the ff of the combined stream (single); "
            "the text stream's ff_context stays in the joint block",
            "the checkpointed loop drops attention_kwargs (diffusers); only the LoRA scale uses them, "
            "and it is applied outside the blocks",
        ),
    )
)
