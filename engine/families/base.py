"""The declarative family adapter: what the segment runner and the trainer need to know of a model.

A family file declares; it does not execute (docs/SCHEDULES.md "A family declares"): its diffusers class, block
lists with their carry maps and FFN/attention boundaries, capabilities, how a training batch becomes the model's
keyword arguments, a tiny preset config (tests, the demo). It registers itself with :func:`~.registry.register_family`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .blocks import SINGLE, ArgSlot, BlockList, Carry, OutputIndex, resolve_blocks  # noqa: F401 (re-exported)
from .conditioning import LatentFormat, TextEncoders
from .frames import FrameRule
from .lazy import import_attribute, torch
from .limits import Limits
from .shift import FlowShift  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class TextSpec:
    """Shapes of the text conditioning a family expects.

    Attributes:
        seq_dim: width D of the per-token embeddings ``(B, L, D)``.
        pooled_dim: width P of the pooled embedding ``(B, P)``, or ``None`` when not used.
        max_length: number of tokens L the default embedder pads/truncates to.
    """

    seq_dim: int
    pooled_dim: int | None = None
    max_length: int = 16


@dataclass(frozen=True)
class TextBatch:
    """Text conditioning of one batch.

    Attributes:
        seq: per-token embeddings, ``(B, L, D)``.
        mask: token mask, ``(B, L)`` bool, True for real tokens.
        pooled: pooled embedding ``(B, P)`` or ``None``.
    """

    seq: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "TextBatch":
        """The same batch on ``device`` (floating tensors cast to ``dtype`` when given)."""
        pooled = None if self.pooled is None else self.pooled.to(device, dtype)
        return TextBatch(self.seq.to(device, dtype), self.mask.to(device), pooled)


MakeInputs = Callable[["torch.nn.Module", "torch.Tensor", "torch.Tensor", TextBatch], dict]
"""``(model, noisy latents (B, C, H, W) or (B, C, F, H, W), sigmas (B,) in [0, 1], text) -> kwargs``."""
ReadOutput = Callable[["torch.nn.Module", Any, "torch.Tensor"], "torch.Tensor"]
"""``(model, model output, noisy latents) -> prediction with the latents' shape``."""


def first_output(model: torch.nn.Module, output: Any, latents: torch.Tensor) -> torch.Tensor:
    """The default :data:`ReadOutput`: ``output[0]``, the prediction of a ``return_dict=False`` call."""
    return output[0]


@dataclass(frozen=True)
class FamilyAdapter:
    """Everything the engine knows of one model family; data plus two small calling functions.

    Attributes:
        name: family name used on the command line (``flux``, ``sd3``, ...).
        model_class: the diffusers class name (``FluxTransformer2DModel``).
        block_lists: the model's block lists, in forward order.
        text: the text conditioning's shapes, a function of the model config.
        make_inputs: builds the model's forward keyword arguments.
        tiny_config: config of the tiny random-init preset (tests and the demo).
        latent_channels: channels C of the VAE latents the model consumes.
        read_output: turns the model output into a prediction shaped like the latents; by
            default :func:`first_output` (the model's first output, as it is).
        video_latents: the model takes ``(B, C, F, H, W)`` latents (a single frame for images).
        objective: ``flow`` (rectified flow: predict ``noise - x0``) or ``epsilon``.
        segmented: the family supports interval/stride (whole-block segments); when ``False``
            the interval and stride are ignored with a warning and every block is per-block.
        stride_honoured: the family honours the stride.
        shared_sigma: one timestep per batch (MiniMax H3): one noise level per micro-batch.
        lora_targets: default LoRA target module names (attention projections).
        notes: free-text notes shown in the support table.
        plan_notes: notes every plan of this family carries (the generic fallback's probe verdict).
        comfy_latents: ComfyUI's latent format (``LATENT`` -> model latents); ``None``: no mapping.
        text_encoders: the text encoders its pipeline uses (``segckpt --text-encoder``), or
            ``None``: one generic local encoder folder at most.
        patch: latent cells per image-token side where the model config's ``patch_size`` does not
            say it (families whose ``make_inputs`` packs the latents itself: Flux's 2x2 is 2);
            ``None``: the config's spatial ``patch_size``, else 1.
        latent_multiple: each latent side's multiple where more than ``patch`` (Qwen-Image 2.1's 2x2).
        aspect_buckets: aspect-ratio buckets apply (``False``: refused, e.g. a 1-D audio sequence).
        limits, frames: the model's size bounds (``engine/families/limits.py``) and a video family's
            frame rule (``engine/families/frames.py``); ``None``: none, one frame.
        attention_ops: attention operators besides the fused SDPA ones whose outputs
            ``gradient_checkpointing_save_attention`` keeps (``engine/core/attention_saving.py``).
        flow_shift: the released scheduler config ``flow_shift=auto`` shifts by (``engine/families/shift.py``).
        guidance_input: the model takes a distilled-guidance input (``guidance_value``, ``conditioning.py``).
    """

    name: str
    model_class: str
    block_lists: tuple[BlockList, ...]
    text: Callable[[Mapping[str, Any]], TextSpec]
    make_inputs: MakeInputs
    tiny_config: Mapping[str, Any]
    latent_channels: int
    read_output: ReadOutput = first_output
    video_latents: bool = False
    objective: str = "flow"
    segmented: bool = True
    stride_honoured: bool = True
    shared_sigma: bool = False
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    notes: tuple[str, ...] = field(default=())
    plan_notes: tuple[str, ...] = field(default=())
    comfy_latents: LatentFormat | None = None
    text_encoders: TextEncoders | None = None
    patch: int | None = None
    latent_multiple: int | None = None
    aspect_buckets: bool = True
    limits: Callable[[Mapping[str, Any]], Limits] | None = None
    frames: FrameRule | None = None
    attention_ops: tuple[Any, ...] = ()
    flow_shift: FlowShift | None = None
    guidance_input: bool = False

    def blocks(self, model: torch.nn.Module, block_list: BlockList) -> torch.nn.ModuleList:
        """The blocks of ``block_list`` in ``model``: the ``nn.ModuleList`` named by
        :attr:`BlockList.attr`, or the modules its path names (see :func:`resolve_blocks`)."""
        plain = getattr(model, block_list.attr, None) if "." not in block_list.attr else None
        if isinstance(plain, torch.nn.ModuleList):
            return plain
        return torch.nn.ModuleList(resolve_blocks(model, block_list.attr))

    def model_cls(self) -> type:
        """The diffusers class ``model_class`` names, imported here (:func:`~.lazy.import_attribute`,
        safe under threads). Raises ImportError when the installed diffusers has no such class."""
        for package in ("diffusers", "diffusers.models"):
            with contextlib.suppress(AttributeError):
                return import_attribute(package, self.model_class)
        raise ImportError(f"diffusers {import_attribute('diffusers', '__version__')} has no class {self.model_class}")
