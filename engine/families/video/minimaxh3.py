"""MiniMax-H3 (``MiniMaxH3Transformer3DModel``): the text token-refiner list, then the main list.

Source: ``diffusers/models/transformers/transformer_minimax_h3.py``,
``modular_pipelines/minimax_h3/before_denoise.py`` / ``denoise.py`` and
``schedulers/scheduling_minimax_h3.py`` (diffusers 0.42.1). The model runs one stack over ONE
packed 1-D sequence (text rows, video rows, audio rows) with full self-attention.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, TextBatch, TextSpec
from ..lazy import lazy_imports, torch
from ..registry import register_family

_VIDEO_TAG, _TEXT_TAG, _AUDIO_TAG = 0, 1, 2  # modular_pipelines/minimax_h3/modular_pipeline.py
_AUDIO_CHANNELS = 2  # stereo, packed channel-major (no audio rows are built here)


# Inputs: the t2va layout of the modular pipeline (MiniMaxH3PrepareLayoutStep.build_packed_sequence)
# with no keyframes and no audio rows, i.e. [text | target video]: video latents patchified
# frame-major (patchify_video_latents), text rows tagged text (1) and video rows video (0), the
# pipeline's fp64 rotary grid, every row at the video timestep; text rows are the batch's longest
# prompt. The model's time is t = 1 - sigma (1 = clean) and it predicts the data-ward velocity
# x0 - noise (MiniMaxH3Scheduler), so _read_output negates it. The layout is shared by every item of
# the batch ("the batch axis is a pure replication axis"): the family declares shared_sigma, and a
# batch whose sigmas differ raises instead of conditioning some samples on the wrong timestep.
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    if bool((sigmas != sigmas[0]).any()):
        raise ValueError(
            "MiniMax-H3 shares one timestep layout across the batch, so a batch cannot hold samples at "
            f"different noise levels (sigmas {sigmas.tolist()}); use batch_size=1")
    # the modular pipeline's helpers: imported here (they pull in diffusers' whole modular-pipeline
    # package, seconds of start-up that no other family needs)
    with lazy_imports():
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3PrepareLayoutStep,
            patchify_video_latents,
        )

    b, c, f, h, w = latents.shape
    patch = tuple(model.config.patch_size)
    length = max(int(text.mask.sum(1).max()), 1)
    positions, tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((length,), _TEXT_TAG, dtype=torch.long), f, h, w, 0, patch, _AUDIO_CHANNELS,
        _AUDIO_TAG, _VIDEO_TAG)
    device = latents.device
    return {
        "hidden_states": patchify_video_latents(latents, patch).view(b, -1, c * patch[0] * patch[1] * patch[2]),
        "audio_hidden_states": latents.new_zeros(b, 0, model.config.audio_in_channels),
        "encoder_hidden_states": text.seq[:, :length],
        "timestep": (1 - sigmas[:1]).to(torch.float32),
        "timestep_indices": torch.zeros(positions.shape[0], dtype=torch.long, device=device),
        "token_tags": tags.to(device),
        "position_ids": positions.to(device),
        "video_indices": video_idx.to(device),
        "audio_indices": audio_idx.to(device),
        "text_indices": text_idx.to(device),
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    b, c, f, h, w = latents.shape
    pt, ph, pw = model.config.patch_size
    x = output[0].reshape(b, f // pt, h // ph, w // pw, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return -x.reshape(b, c, f, h, w)


# The token refiner (token_refiner.refiner_blocks, a nested list declared by its dotted path) calls
# its blocks as block(text); the main loop as block(hidden, temb, adaln_indices, rotary_emb). Every
# block returns its hidden state alone and every other argument is the same object for every block
# of a list, so both lists carry SINGLE.
MINIMAXH3 = register_family(
    FamilyAdapter(
        name="minimaxh3",
        model_class="MiniMaxH3Transformer3DModel",
        block_lists=(
            BlockList("refiner", "token_refiner.refiner_blocks", SINGLE, ffn="ff", attention="attn"),
            BlockList("blocks", "transformer_blocks", SINGLE, ffn="ff", attention="attn"),
        ),
        text=lambda cfg: TextSpec(cfg["text_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "hidden_size": 32,
            "num_layers": 8,
            "num_refiner_layers": 4,
            "ffn_dim": 64,
            "in_channels": 24,
            "audio_in_channels": 8,
            "patch_size": (1, 2, 2),
            "text_dim": 32,
            "freq_dim": 32,
            "time_embed_hidden_dim": 32,
            "time_embed_dim": 32,
            "rope_freq_dim": 2,  # 2 x 3 x 2 = 12 of the 16 head channels rotated
        },
        latent_channels=24,  # the MiniMax-H3 video VAE
        video_latents=True,
        shared_sigma=True,
        notes=(
            "one noise level per batch: the packed layout (timesteps, tags, positions) is shared by the "
            "batch, so the trainer draws one sigma per micro-batch (shared_sigma)",
            "video-only: the t2va layout without audio rows (the pipeline always generates a soundtrack)",
            "time runs backwards (t = 1 - sigma) and the raw output is x0 - noise; the adapter negates it",
            "the refiner list is nested (token_refiner.refiner_blocks); the model has no text mask",
        ),
    )
)
