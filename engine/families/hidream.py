"""HiDream-I1 (``HiDreamImageTransformer2DModel``): double- then single-stream lists; per-block only.

Source: ``diffusers/models/transformers/transformer_hidream_image.py`` (forward loop) and
``diffusers/pipelines/hidream_image/pipeline_hidream_image.py`` (how the pipeline calls the
transformer).

Blocks are ``HiDreamBlock`` wrappers around the real block (``.block``). Double blocks are called
as ``block(hidden, masks, cur_encoder, temb, rope)`` and return ``(hidden, encoder)``; single
blocks as ``block(joint, masks, None, temb, rope)`` and return the joint sequence. Between blocks
the loop changes the text: before double block ``i`` it builds
``cur_encoder = cat([initial_encoder, llama_i])`` with a different Llama layer ``llama_i`` per
block, and after it keeps only ``encoder[:, :initial_len]``; before single block ``i`` it appends
``llama_i`` to the joint sequence and after it cuts the sequence back. A carry map only maps a
block's outputs to the next block's arguments, so it cannot express a per-block concatenation
and slice; the family is declared ``segmented=False``: interval and stride are ignored with a
warning and every block is checkpointed on its own (the documents list HiDream in the sweep
"with notes", not among the segmented whole-block families). Engine change that would allow
segments: a per-list "between blocks" hook ``advance(model, block_index, output, args, kwargs)``
that the runner applies inside the region instead of the plain carry (here: slice the output,
concatenate the next Llama layer, which the hook would read from the model inputs), and that the
pass-through check compares by value.

FFN boundary: ``block.ff_i``, the image stream's mixture-of-experts SwiGLU (``MOEFeedForwardSwiGLU``)
called on one tensor (the double blocks' text-stream ``ff_t`` stays in the block); attention
boundary: ``block.attn1``. In training mode the MoE gate routes by ``topk``; a recompute sees the
same inputs and routes identically. Its auxiliary load-balancing loss is computed but not added by
diffusers (the ``AddAuxiliaryLoss`` line is commented out), so it plays no part here either.

Conventions (``pipeline_hidream_image.py``): 16-channel Flux VAE latents ``(B, C, H, W)``, which
the model patchifies itself; the timestep is the scheduler's ``sigma * 1000``; the raw output is
``x0 - noise`` (the pipeline negates it), so :func:`_read_output` negates it to give the flow
velocity ``noise - x0``. In training mode the model returns ``(B, C, h*w, p*p)`` patches instead of
the image, which :func:`_read_output` folds back. Text: a T5 sequence ``(B, L, caption_channels[0])``,
a stack of Llama hidden states indexed by ``llama_layers`` and a pooled CLIP embedding
``(B, text_emb_dim)``. The adapter's text batch carries T5 and the distinct Llama layers it needs
side by side in one ``(B, L, caption_channels[0] + n * caption_channels[1])`` sequence (T5 first,
then the layers in ascending index order) and :func:`_make_inputs` splits it; the model takes no
text mask.
"""

from __future__ import annotations

import torch

from .base import BlockList, Carry, FamilyAdapter, TextBatch, TextSpec, register_family

# double: block(hidden, masks, encoder, temb, rope) -> (hidden, encoder). Per-block only, so these
# carries never chain blocks; they name each block's hidden-state inputs (the unsloth boundary).
_DOUBLE = Carry(((0, 0), (1, 2)))
_SINGLE = Carry(((None, 0),))


def _llama_layers(cfg) -> list[int]:
    """The distinct Llama layers the model reads, in ascending order."""
    return sorted(set(cfg["llama_layers"]))


def _text_spec(cfg) -> TextSpec:
    t5_dim, llama_dim = cfg["caption_channels"]
    return TextSpec(t5_dim + len(_llama_layers(cfg)) * llama_dim, cfg["text_emb_dim"])


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
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
        "timesteps": sigmas.to(latents.dtype) * 1000,  # the pipeline passes scheduler timesteps
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
    return -x


def _blocks(name: str, attr: str, carry: Carry) -> BlockList:
    return BlockList(name, attr, carry, ffn="block.ff_i", attention="block.attn1")


HIDREAM = register_family(
    FamilyAdapter(
        name="hidream",
        model_class="HiDreamImageTransformer2DModel",
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
