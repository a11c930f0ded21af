"""Ideogram 4 (``Ideogram4Transformer2DModel``): one list of single-stream blocks over a packed
text + image sequence.

Source: ``diffusers/models/transformers/transformer_ideogram4.py`` and
``diffusers/pipelines/ideogram4/pipeline_ideogram4.py`` (diffusers 0.42).
"""

from __future__ import annotations

from ..base import SINGLE, BlockList, FamilyAdapter, FlowShift, TextBatch, TextSpec
from ..lazy import torch
from ..registry import register_family

_TEXT, _IMAGE, _IMAGE_POSITION_OFFSET = 3, 2, 65536  # transformer_ideogram4.py constants
_PATCH = 2  # the pipeline patchifies the VAE latents by 2 before the transformer


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(B, H/2 * W/2, 4C)`` with channels ordered ``(ph, pw, c)``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // _PATCH, _PATCH, w // _PATCH, _PATCH).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // _PATCH) * (w // _PATCH), _PATCH * _PATCH * c)


def _unpatchify(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_patchify` (the pipeline's decode-time reshape)."""
    b, _, d = tokens.shape
    c = d // (_PATCH * _PATCH)
    x = tokens.view(b, height // _PATCH, width // _PATCH, _PATCH, _PATCH, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, height, width)


# As the pipeline builds them: one packed sequence [text tokens][image tokens]; hidden_states holds
# zeros at text positions and the 2x2-patchified latents (channels (ph, pw, c), the pipeline's
# unpatchify in reverse) at image positions; encoder_hidden_states the text features at text
# positions and zeros at image positions; indicator marks text (3) / image (2) / padding (0),
# segment_ids is 1 for real tokens and -1 for padding, position_ids are (i, i, i) for the i-th real
# text token and (0, h, w) + 65536 for image tokens. The pipeline left-pads the text; attention is
# permutation-equivariant apart from the rotary positions and the segment mask, so keeping the
# batch's own token order with the same ids is the same computation. Model time runs the other way
# (t = 1 - sigma, 1 = clean) and the model predicts x0 - noise (the pipeline steps the scheduler
# with -v), so _read_output negates it to give the flow velocity noise - x0.
def _make_inputs(model, latents: torch.Tensor, sigmas: torch.Tensor, text: TextBatch) -> dict:
    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    image = _patchify(latents)
    n_text, n_image = text.seq.shape[1], image.shape[1]
    mask = text.mask.to(device)

    gh, gw = h // _PATCH, w // _PATCH
    grid = torch.stack(torch.meshgrid(torch.zeros(1, dtype=torch.long), torch.arange(gh), torch.arange(gw),
                                      indexing="ij"), dim=-1).reshape(-1, 3).to(device) + _IMAGE_POSITION_OFFSET
    text_pos = ((mask.long().cumsum(1) - 1) * mask.long()).unsqueeze(-1).expand(b, n_text, 3)
    position_ids = torch.cat([text_pos, grid.unsqueeze(0).expand(b, n_image, 3)], dim=1)
    ones = torch.ones(b, n_image, dtype=torch.long, device=device)
    indicator = torch.cat([mask.long() * _TEXT, ones * _IMAGE], dim=1)
    segment_ids = torch.cat([torch.where(mask, 1, -1), ones], dim=1)

    features = text.seq.to(device, dtype) * mask.unsqueeze(-1).to(dtype)
    return {
        "hidden_states": torch.cat([image.new_zeros(b, n_text, image.shape[-1]), image], dim=1),
        "timestep": 1 - sigmas.to(device, dtype),
        "encoder_hidden_states": torch.cat([features, features.new_zeros(b, n_image, features.shape[-1])], dim=1),
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
        "return_dict": False,
    }


def _read_output(model, output, latents: torch.Tensor) -> torch.Tensor:
    n_image = (latents.shape[-2] // _PATCH) * (latents.shape[-1] // _PATCH)
    return -_unpatchify(output[0][:, -n_image:], latents.shape[-2], latents.shape[-1])


# block(hidden, attention_mask, (cos, sin), adaln_input) -> hidden; the mask, the rotary tuple and
# the AdaLN input are built once before the loop, so the plain single-tensor carry is exact. No
# attention/FFN boundary, as the documents list it (docs/SCHEDULES.md "Families named by the
# documents").
IDEOGRAM4 = register_family(
    FamilyAdapter(
        name="ideogram4",
        model_class="Ideogram4Transformer2DModel",
        # The pipeline draws its inference sigmas as logit-normal quantiles around
        # mu = _resolution_aware_mu(height, width, mu=0): an exponential time shift by that mu (16 px per token:
        # the VAE's 8 x the 2x2 patch). Its std 1.5 is not carried over (logit_std stays the option's).
        flow_shift=FlowShift(use_dynamic_shifting=True, mu_rule="ideogram4.pipeline_ideogram4:_resolution_aware_mu",
                             mu_pixels_per_token=256,
                             source="pipeline_ideogram4.py (diffusers 0.42): _resolution_aware_mu at mu 0"),
        block_lists=(BlockList("blocks", "layers", SINGLE, ffn=None, attention=None),),
        text=lambda cfg: TextSpec(cfg["llm_features_dim"]),
        make_inputs=_make_inputs,
        read_output=_read_output,
        tiny_config={
            "in_channels": 128,
            "num_layers": 8,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "adaln_dim": 16,
            "llm_features_dim": 32,
            "mrope_section": (2, 2, 2),
        },
        latent_channels=32,
        patch=2,  # make_inputs patchifies 2x2 latents (_PATCH)
        notes=(
            "no attention/FFN boundary (documents): *-ffn backends and attention offload are refused",
            "latents are the 32-channel AutoencoderKLFlux2 latents, 2x2-patchified here to 128 channels; the "
            "pipeline also normalises the patchified latents with the VAE's batch-norm statistics (vae.bn), "
            "which this adapter does not apply",
            "only the conditional transformer is trained; the pipeline's unconditional_transformer is a "
            "separate model",
        ),
    )
)
