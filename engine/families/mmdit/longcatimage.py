"""LongCat-Image (``LongCatImageTransformer2DModel``): a double-stream list, then a single-stream list.

Source: ``diffusers/models/transformers/transformer_longcat_image.py`` (forward loop) and
``diffusers/pipelines/longcat_image/pipeline_longcat_image.py`` (how the pipeline calls the
transformer). Conventions: 16-channel Flux-style VAE latents, 2x2-packed; the timestep is sigma
(the model multiplies by 1000); ``guidance`` is unused by the model.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..packing import pack_2x2, read_packed_2x2
from ..registry import register_family

# both lists: block(hidden, encoder, temb, rope) -> (encoder, hidden) (the single blocks concatenate
# the streams inside and split them again on return); temb and rope are computed once before the
# loops. The model's per-block switches use_checkpoint / use_single_checkpoint (all True by default)
# call a switched-off block directly: the runner then sees a segment's next block never arrive and
# falls back to per-block for that list.
_CARRY = Carry(((0, 1), (1, 0)))


_IMAGE_START = 512  # LongCatImagePipeline.tokenizer_max_length


# ids are (modality, row, col): text tokens (0, i, i), image tokens (1, 512 + h, 512 + w) (the
# pipeline starts the image grid at its fixed text length of 512 tokens). No text mask and no pooled
# embedding: the pipeline pads prompts to 512 tokens and passes them whole.
def _text_ids(length: int, device: torch.device) -> torch.Tensor:
    ids = torch.zeros(length, 3)
    ids[:, 1] = ids[:, 2] = torch.arange(length)
    return ids.to(device)


def _image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    ids = torch.zeros(height, width, 3)
    ids[..., 0] = 1
    ids[..., 1] = torch.arange(height)[:, None] + _IMAGE_START
    ids[..., 2] = torch.arange(width)[None, :] + _IMAGE_START
    return ids.reshape(height * width, 3).to(device)


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    _, _, h, w = latents.shape
    return {
        "hidden_states": pack_2x2(latents),
        "encoder_hidden_states": text.seq,
        "timestep": sigmas.to(latents.dtype),  # the model multiplies by 1000 itself
        "txt_ids": _text_ids(text.seq.shape[1], latents.device),
        "img_ids": _image_ids(h // 2, w // 2, latents.device),
        "return_dict": False,
    }


# FFN boundary: the double blocks call ff on one tensor (the text stream's ff_context stays in the
# block); the single blocks run the MLP branch act_mlp(proj_mlp(x)) in parallel with attention (as
# in Flux), so their FFN region is that chain and the fused proj_out stays outside.
LONGCATIMAGE = register_family(
    FamilyAdapter(
        name="longcatimage",
        model_class="LongCatImageTransformer2DModel",
        block_lists=(
            BlockList("double", "transformer_blocks", _CARRY, ffn="ff", attention="attn"),
            BlockList("single", "single_transformer_blocks", _CARRY, ffn=("proj_mlp", "act_mlp"),
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
            "pooled_projection_dim": 32,  # stored in the config, unused by the model
            "axes_dims_rope": (4, 6, 6),  # sums to the head dim
        },
        latent_channels=16,
        patch=2,  # make_inputs packs 2x2 latents (config patch_size is 1)
        notes=(
            "single-stream blocks return (encoder, hidden) like the double ones; their FFN region is the "
            "MLP branch act_mlp(proj_mlp(x)); the fused output projection stays outside it",
            "the model's per-block use_checkpoint switches must stay True (a switched-off block is called "
            "directly and the runner falls back to per-block for its list)",
            "no text mask: the model takes none; image ids start at 512 as in the pipeline",
        ),
    )
)
