"""ERNIE-Image (``ErnieImageTransformer2DModel``): one list of shared-AdaLN single-stream blocks.

Source: ``diffusers/models/transformers/transformer_ernie_image.py`` and
``diffusers/pipelines/ernie_image/pipeline_ernie_image.py`` (diffusers 0.42). The model predicts
the flow velocity ``noise - x0`` directly.
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family
from ..timesteps import scheduler_timesteps


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, 4C, H/2, W/2)`` (the pipeline's ``_patchify_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def _unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_patchify` (the pipeline's ``_unpatchify_latents``)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    # As the pipeline builds them: the 32-channel Flux.2 VAE latents 2x2-patchified to 128 channels
    # (channel order (c, ph, pw)) at half resolution; the text as text_bth, padded with zeros after
    # each prompt's real tokens, plus text_lens (real tokens are moved first, whatever the batch's mask
    # layout); the timestep is the scheduler timestep.
    mask = text.mask.to(latents.device)
    # real tokens first, zeros after them (the pipeline's _pad_text layout)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    seq = torch.gather(text.seq.to(latents.device, latents.dtype), 1,
                       order.unsqueeze(-1).expand(-1, -1, text.seq.shape[-1]))
    kept = torch.gather(mask, 1, order)
    return {
        "hidden_states": _patchify(latents),
        "timestep": scheduler_timesteps(sigmas, latents.dtype),  # FlowMatchEulerDiscreteScheduler timesteps
        "text_bth": seq * kept.unsqueeze(-1).to(seq.dtype),
        "text_lens": mask.sum(dim=1),
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    return _unpatchify(output[0])


# block(x, rotary_pos_emb, temb, attention_mask) -> x, with x the sequence-first (S, B, D) image +
# text tokens. temb is a fresh Python list on every iteration but holds the same six modulation
# tensors each time (AdaLN is shared by all blocks), so the plain single-tensor carry is exact. FFN
# boundary: mlp (called once on one tensor); attention boundary: self_attention. The LoRA targets
# add adaLN_modulation.1 and final_linear (see the notes): with a non-zero LoRA they open the
# gradient path of the tiny preset; on pretrained weights they are ordinary, small targets.
ERNIEIMAGE = register_family(
    FamilyAdapter(
        name="ernieimage",
        model_class="ErnieImageTransformer2DModel",
        flow_shift=FlowShift(3.0, source="ERNIE-Image scheduler config, as ai-toolkit declares it"),
        block_lists=(BlockList("blocks", "layers", SINGLE, ffn="mlp", attention="self_attention"),),
        text=lambda cfg: TextSpec(cfg["text_in_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_layers": 8,
            "ffn_hidden_size": 64,
            "in_channels": 128,
            "out_channels": 128,
            "patch_size": 1,
            "text_in_dim": 24,
            "rope_axes_dim": (4, 6, 6),
        },
        latent_channels=32,
        patch=2,  # make_inputs patchifies 2x2 latents into channels (config patch_size is 1)
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "adaLN_modulation.1", "final_linear"),
        notes=(
            "latents are the 32-channel AutoencoderKLFlux2 latents, 2x2-patchified here to 128 channels; the "
            "pipeline also normalises them with the VAE's batch-norm statistics (vae.bn), which this adapter "
            "does not apply",
            "default LoRA targets include adaLN_modulation.1 and final_linear: the diffusers class "
            "zero-initialises them, so a random-init model has no gradient path through attention-only LoRA",
        ),
    )
)
