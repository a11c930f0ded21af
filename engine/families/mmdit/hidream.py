"""HiDream-I1 (``HiDreamImageTransformer2DModel``): double- then single-stream lists; per-block only.

Source: ``diffusers/models/transformers/transformer_hidream_image.py`` (forward loop) and
``diffusers/pipelines/hidream_image/pipeline_hidream_image.py`` (how the pipeline calls the
transformer). Conventions: 16-channel Flux VAE latents ``(B, C, H, W)``, which the model
patchifies itself; the timestep is the scheduler timestep; the model takes no text mask.
"""

from __future__ import annotations

from ..base import BlockList, Carry, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..position_tables import hidream_tokens
from ..registry import register_family
from ..timesteps import scheduler_timesteps

# Blocks are HiDreamBlock wrappers around the real block (.block). double: block(hidden, masks,
# cur_encoder, temb, rope) -> (hidden, encoder); single: block(joint, masks, None, temb, rope) ->
# joint. Between blocks the loop changes the text (before double block i: cur_encoder =
# cat([initial_encoder, llama_i]), after it: encoder[:, :initial_len]; before single block i it
# appends llama_i to the joint sequence, after it cuts it back), which a carry map cannot express:
# segmented=False (the documents list HiDream in the sweep "with notes"). Engine change that would
# allow segments: a per-list "between blocks" hook advance(model, block_index, output, args, kwargs)
# applied by the runner inside the region instead of the plain carry (slice the output, concatenate
# the next Llama layer read from the model inputs), compared by value by the pass-through check.
# Per-block only, so these carries never chain blocks; they name each block's hidden-state inputs
# (the unsloth boundary).
_DOUBLE = Carry(((0, 0), (1, 2)))


_SINGLE = Carry(((None, 0),))


def _llama_layers(cfg) -> list[int]:
    """The distinct Llama layers the model reads, in ascending order."""
    return sorted(set(cfg["llama_layers"]))


def _text_spec(cfg) -> TextSpec:
    t5_dim, llama_dim = cfg["caption_channels"]
    return TextSpec(t5_dim + len(_llama_layers(cfg)) * llama_dim, cfg["text_emb_dim"])


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # text.seq holds T5 (B, L, caption_channels[0]) and the distinct Llama layers side by side
    # (B, L, caption_channels[0] + n * caption_channels[1]); the model takes T5, a stack of Llama
    # hidden states indexed by llama_layers, and the pooled CLIP embedding (B, text_emb_dim)
    cfg = model.config
    t5_dim, llama_dim = cfg.caption_channels
    layers = _llama_layers(cfg)
    t5, llama = text.seq.split([t5_dim, len(layers) * llama_dim], dim=-1)
    llama = llama.unflatten(-1, (len(layers), llama_dim)).permute(2, 0, 1, 3)  # (n, B, L, D)
    # the model indexes the stack by Llama layer number: unused layers are zeros, never read
    stack = llama.new_zeros(max(layers) + 1, *llama.shape[1:]).index_copy(
        0, torch.tensor(layers, device=llama.device), llama)
    return {
        "hidden_states": latents,
        "timesteps": scheduler_timesteps(sigmas, latents.dtype),  # the pipeline passes scheduler timesteps
        "encoder_hidden_states_t5": t5,
        "encoder_hidden_states_llama3": stack,
        "pooled_embeds": text.pooled,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    x = output[0]
    b, c, h, w = latents.shape
    if x.shape != latents.shape:  # training-mode output: (B, C, tokens, p*p) patches
        p = model.config.patch_size
        x = x[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
        x = x.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
    return -x  # the raw output is x0 - noise (the pipeline negates it): the velocity is its negation


# FFN boundary: block.ff_i, the image stream's mixture-of-experts SwiGLU (MOEFeedForwardSwiGLU) on
# one tensor; attention boundary: block.attn1. In training mode the MoE gate routes by topk; a
# recompute sees the same inputs and routes identically. Its auxiliary load-balancing loss is
# computed but not added by diffusers (the AddAuxiliaryLoss line is commented out), nor here.
def _blocks(name: str, attr: str, carry: Carry) -> BlockList:
    return BlockList(name, attr, carry, ffn="block.ff_i", attention="block.attn1")


HIDREAM = register_family(
    FamilyAdapter(
        name="hidream",
        model_class="HiDreamImageTransformer2DModel",
        flow_shift=FlowShift(3.0, mu_rule="hidream_image.pipeline_hidream_image:calculate_shift",
                             source="HiDream-ai/HiDream-I1-Full, as ai-toolkit declares it"),
        block_lists=(
            _blocks("double", "double_stream_blocks", _DOUBLE),
            _blocks("single", "single_stream_blocks", _SINGLE),
        ),
        text=_text_spec,
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "patch_size": 2,
            "in_channels": 16,
            # the SwiGLU width is rounded up to a multiple of 256 inside diffusers (multiple_of is not a
            # config key), so the FFNs dominate: 4 blocks per list and 2 experts keep it near 0.8M
            "num_layers": 4,
            "num_single_layers": 4,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "caption_channels": (32, 16),  # (T5, Llama)
            "text_emb_dim": 32,
            "num_routed_experts": 2,
            "num_activated_experts": 1,
            "axes_dims_rope": (8, 4, 4),  # sums to the head dim
            "llama_layers": [0, 1] * 4,  # one entry per block (num_layers + num_single_layers)
        },
        latent_channels=16,
        limits=hidream_tokens,
        segmented=False,
        lora_targets=("to_q", "to_k", "to_v", "to_out"),
        notes=(
            "per-block only: the loop concatenates a different Llama layer to the text before every "
            "block and slices it off after, which a carry map cannot express; interval and stride are "
            "ignored with a warning",
            "FFN boundary is the image stream's mixture-of-experts block.ff_i; the text stream's ff_t "
            "stays in the block",
            "text conditioning: T5 and the distinct Llama layers side by side in one sequence "
            "(T5 first, Llama layers in ascending order); pooled CLIP embedding as pooled",
            "the raw output is x0 - noise (the pipeline negates it); the adapter negates it",
        ),
    )
)
