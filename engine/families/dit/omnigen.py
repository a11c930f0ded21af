"""OmniGen (``OmniGenTransformer2DModel``): one list of decoder (Phi-3 style) blocks.

Source: ``diffusers/models/transformers/transformer_omnigen.py`` and
``pipelines/omnigen/pipeline_omnigen.py`` / ``processor_omnigen.py`` (diffusers 0.42.1).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import torch
from ..position_tables import pos_embed_grid
from ..registry import register_family


# OmniGen conditions on Phi-3 token ids embedded by its own embed_tokens and has no input for text
# embeddings (what TextBatch carries), so the adapter trains the text-free mode (input_ids=None: the
# sequence is [time token, image tokens]) with the attention mask and positions the OmniGen
# processor builds for an empty condition: the time token attends to itself, image tokens to
# everything. The diffusers OmniGen scheduler is FlowMatchEulerDiscreteScheduler(invert_sigmas=True,
# num_train_timesteps=1): the model's time is t = 1 - sigma (1 = clean) and it predicts x0 - noise,
# so _read_output negates it.
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    p = model.config.patch_size
    image_tokens = (h // p) * (w // p)
    seq = 1 + image_tokens  # [time token, image tokens]
    mask = torch.ones(seq, seq, device=latents.device, dtype=latents.dtype)
    mask[0, 1:] = 0  # processor create_mask with an empty condition: the time token sees itself only
    return {
        "hidden_states": latents,
        "timestep": 1 - sigmas.to(latents.dtype),
        "input_ids": None,
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask.expand(b, seq, seq),
        "position_ids": torch.arange(seq, device=latents.device).expand(b, seq),
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return -output[0]


# Under gradient checkpointing the loop calls every block as block(hidden, attention_mask, rotary_emb)
# -> hidden; the mask and the rotary embedding are the same objects for every block, so SINGLE and
# whole-block segments are exact. The documents list OmniGen as "none and full-block only"; the
# loop shows no state change between blocks and the segment gradient test passes: segmented.
OMNIGEN = register_family(
    FamilyAdapter(
        name="omnigen",
        model_class="OmniGenTransformer2DModel",
        block_lists=(BlockList("layers", "layers", SINGLE, ffn="mlp", attention="self_attn"),),
        text=lambda cfg: TextSpec(cfg["hidden_size"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_channels": 4,
            "patch_size": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_layers": 8,
            "pad_token_id": 0,
            "vocab_size": 64,
            "rope_scaling": {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8},  # head_dim / 2 each
            "pos_embed_max_size": 32,  # patches per side: latents up to 64 x 64 (512 px)
        },
        latent_channels=4,  # the SDXL VAE
        limits=pos_embed_grid,
        notes=(
            "captions are not used: OmniGen embeds Phi-3 token ids with its own embed_tokens and has no "
            "input for text embeddings; the adapter trains the text-free mode (input_ids=None)",
            "time runs backwards (t = 1 - sigma) and the raw output is x0 - noise; the adapter negates it",
            "the documents say 'none and full-block only'; the diffusers loop passes the same mask and "
            "rotary embedding to every block, and segmented schedules give gradients equal to per-block",
            "input images (editing / subject-driven modes) are not built here",
        ),
    )
)
