"""Training data a caller prepared: ComfyUI's ``LATENT`` and ``CONDITIONING`` as a run's latents and text.

The formats, as ComfyUI 0.3.64 makes them (``nodes.py`` VAEEncode and CLIPTextEncode,
``comfy/sd.py`` ``encode_from_tokens_scheduled``) and as its own trainer pairs them
(``comfy_extras/nodes_train.py`` TrainLoraNode: one conditioning for all images, or one per image):

- ``LATENT``: ``{"samples": (B, C, H, W)}``, or ``(B, C, T, H, W)`` from a video VAE, in the VAE's
  raw latent space (ComfyUI normalises inside the model with the latent format's ``process_in``).
  A list of LATENT dicts is concatenated along B, in order; other keys (``noise_mask``,
  ``batch_index``) are ignored.
- ``CONDITIONING``: a list of entries ``[cond (1, L, D), {"pooled_output": (1, P) or None,
  "attention_mask": (1, L) (optional), ...}]``; other keys (guidance, hooks, areas) are ignored.

:func:`prepare_comfy_data` turns them into the cache the image path produces
(:func:`.cache.prepare_cache`), which :class:`~..train.loop.TrainingRun` takes as ``prepared=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..families import FamilyAdapter, TextSpec, family_names, get_family
from ..families.conditioning import LatentFormat
from .folder import DatasetError

SOURCE = "ComfyUI LATENT + CONDITIONING"


class ComfyDataError(DatasetError):
    """ComfyUI latents or conditioning that cannot train the model; the message says what and why."""


@dataclass(frozen=True)
class PreparedData:
    """Latents and text embeddings a caller prepared, trained on instead of an image folder.

    Attributes:
        family: the family they were prepared for.
        cache: what :func:`.cache.prepare_cache` returns: ``latents (N, C, H, W)`` or
            ``(N, C, T, H, W)`` float32, normalised; ``text_seq (N, L, D)`` float32; ``text_mask
            (N, L)`` bool; ``text_pooled (N, P)`` float32 when the family uses pooled vectors.
        summary: JSON-ready description (``report.json`` ``dataset``).
    """

    family: str
    cache: dict[str, torch.Tensor]
    summary: dict[str, Any]

    @property
    def count(self) -> int:
        """Samples N (one epoch: each once)."""
        return self.cache["text_seq"].shape[0]  # one text row per latent

    def describe(self) -> str:
        """One log line: source, count, shapes, how the conditioning was paired."""
        s = self.summary
        return (f"{s['images']} latents {tuple(s['latent_shape'])} from {s['source']} ({s['latent_format']}), "
                f"conditioning {s['conditioning']}, text {s['text_tokens']}x{s['text_width']}")


def comfy_mapped_families() -> list[str]:
    """Families with a ComfyUI latent mapping, sorted."""
    return [name for name in family_names() if get_family(name).comfy_latents is not None]


def comfy_latent_format(family: FamilyAdapter) -> LatentFormat:
    """The family's ComfyUI latent format.

    Raises:
        ComfyDataError: the family has none (one line naming it and the families that have one).
    """
    if family.comfy_latents is None:
        raise ComfyDataError(
            f"family {family.name!r} has no ComfyUI latent mapping: Train LoRA cannot train it on LATENT + "
            f"CONDITIONING (families with one: {', '.join(comfy_mapped_families())}); connect an "
            "Image+Caption Dataset to its dataset input instead")
    return family.comfy_latents


def prepare_comfy_data(family: FamilyAdapter, text: TextSpec, latent: Mapping | Sequence[Mapping],
                       conditioning: Sequence) -> PreparedData:
    """ComfyUI's ``LATENT`` (a dict or a list of dicts) and ``CONDITIONING`` -> :class:`PreparedData`.

    Args:
        family: the model's family.
        text: the model's text shapes (``family.text(model.config)``): widths D and P.
        latent: ``{"samples": (B, C, H, W) or (B, C, T, H, W)}`` raw VAE latents, or a list of them.
        conditioning: entries ``[cond (1, L, D), {"pooled_output": ..., "attention_mask": ...}]``:
            one for all N latents, or N (one per latent, in order). Prompts of different lengths
            are zero-padded to the longest with a False mask.

    Raises:
        ComfyDataError: the family has no ComfyUI mapping; the latents' channels or frames do not
            fit the family; an entry's width D is not the model's text width; the pooled vector
            is missing or of another width; the counts of latents and entries do not pair;
            non-finite values.
    """
    fmt = comfy_latent_format(family)
    raw = _model_layout(family, fmt, _gather_latents(latent))
    latents = fmt.process_in(raw.float())
    count = latents.shape[0]
    entries = list(conditioning) if isinstance(conditioning, (list, tuple)) else None
    if not entries:
        raise ComfyDataError("conditioning is empty or not a list of [cond, dict] entries: connect CLIP Text Encode")
    if len(entries) not in (1, count):
        raise ComfyDataError(f"{count} latents but {len(entries)} conditioning entries: give one conditioning for "
                             f"all images, or one per image ({count}), in the latents' order")
    rows = [_entry(family, text, i, entry) for i, entry in enumerate(entries)]
    length = max(seq.shape[0] for seq, _, _ in rows)
    seq = torch.zeros(len(rows), length, text.seq_dim)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (s, m, _) in enumerate(rows):
        seq[i, : s.shape[0]], mask[i, : m.shape[0]] = s, m
    pick = [0] * count if len(rows) == 1 else list(range(count))
    cache = {"latents": latents.contiguous(), "text_seq": seq[pick].contiguous(), "text_mask": mask[pick].contiguous()}
    if text.pooled_dim:
        cache["text_pooled"] = torch.stack([rows[i][2] for i in pick])
    summary = {"source": SOURCE, "images": count, "images_per_epoch": count, "latent_shape": list(latents.shape[1:]),
               "latent_format": fmt.describe(), "conditioning": "one for all images" if len(rows) == 1 and count > 1
               else "one per image", "text_tokens": length, "text_width": text.seq_dim, "pooled_width": text.pooled_dim}
    return PreparedData(family.name, cache, summary)


def _gather_latents(latent: Mapping | Sequence[Mapping]) -> torch.Tensor:
    """The ``samples`` of one LATENT, or of a list of them concatenated along B."""
    parts = [latent] if isinstance(latent, Mapping) else list(latent) if isinstance(latent, (list, tuple)) else []
    if not parts:
        raise ComfyDataError("latent is not a LATENT ({'samples': tensor}) or a list of them: connect VAE Encode")
    samples = []
    for i, part in enumerate(parts):
        tensor = part.get("samples") if isinstance(part, Mapping) else None
        if not isinstance(tensor, torch.Tensor) or tensor.ndim not in (4, 5):
            raise ComfyDataError(f"latent {i} has no 'samples' tensor of shape (B, C, H, W) or (B, C, T, H, W)")
        if samples and tensor.shape[1:] != samples[0].shape[1:]:
            raise ComfyDataError(f"latent {i} has shape {tuple(tensor.shape[1:])} but latent 0 has "
                                 f"{tuple(samples[0].shape[1:])}: one dataset needs one latent size")
        samples.append(tensor.detach().cpu())
    out = torch.cat(samples)
    if not torch.isfinite(out).all():
        raise ComfyDataError("latent samples hold NaN or infinite values")
    return out


def _model_layout(family: FamilyAdapter, fmt: LatentFormat, samples: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` for an image family, ``(B, C, T, H, W)`` for a video-latent one."""
    if samples.shape[1] != family.latent_channels:
        raise ComfyDataError(
            f"latent has {samples.shape[1]} channels but family {family.name!r} takes {family.latent_channels} "
            f"(ComfyUI latent format {fmt.name}): encode the images with the model's own VAE")
    frames = samples.shape[2] if samples.ndim == 5 else 1
    allowed = 1 if not family.video_latents else fmt.frames
    if allowed is not None and frames != allowed:
        raise ComfyDataError(f"latent has {frames} latent frames but family {family.name!r} trains on images "
                             "(1 frame each): encode single images, not a video")
    if family.video_latents:
        return samples if samples.ndim == 5 else samples.unsqueeze(2)
    return samples.squeeze(2) if samples.ndim == 5 else samples


def _entry(family: FamilyAdapter, text: TextSpec, i: int,
           entry: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One conditioning entry as ``(seq (L, D), mask (L,), pooled (P,) or None)``, float32 on the CPU."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], torch.Tensor)
            and isinstance(entry[1], Mapping)):
        raise ComfyDataError(f"conditioning entry {i} is not [cond tensor, dict] (what CLIP Text Encode gives)")
    cond, extra = entry
    if cond.ndim != 3 or cond.shape[0] != 1:
        raise ComfyDataError(f"conditioning entry {i} has cond of shape {tuple(cond.shape)}: allowed (1, L, D), "
                             "one prompt per entry")
    if cond.shape[2] != text.seq_dim:
        raise ComfyDataError(f"conditioning entry {i} has width {cond.shape[2]} but the {family.name} model's text "
                             f"width is {text.seq_dim}: encode with the text encoder(s) of this model")
    seq = cond[0].detach().cpu().float()
    mask = torch.ones(seq.shape[0], dtype=torch.bool)
    given = extra.get("attention_mask")
    if given is not None:
        if not isinstance(given, torch.Tensor) or given.numel() != seq.shape[0]:
            raise ComfyDataError(f"conditioning entry {i}: attention_mask does not cover its {seq.shape[0]} tokens")
        mask = given.detach().cpu().reshape(-1).bool()
    pooled = None
    if text.pooled_dim:
        pooled = extra.get("pooled_output")
        if not isinstance(pooled, torch.Tensor) or pooled.numel() != text.pooled_dim:
            got = "none" if not isinstance(pooled, torch.Tensor) else f"shape {tuple(pooled.shape)}"
            raise ComfyDataError(f"conditioning entry {i} has pooled_output {got} but the {family.name} model takes "
                                 f"a pooled vector of width {text.pooled_dim}: encode with this model's CLIP")
        pooled = pooled.detach().cpu().float().reshape(-1)
    if not torch.isfinite(seq).all() or (pooled is not None and not torch.isfinite(pooled).all()):
        raise ComfyDataError(f"conditioning entry {i} holds NaN or infinite values")
    return seq, mask, pooled
