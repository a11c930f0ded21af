"""What the pack's nodes pass to each other: one dataclass (or engine object) per socket type.

``SEGCKPT_MODEL``: :class:`ModelSource`; ``SEGCKPT_DATASET``: the engine's ``DataConfig``;
``SEGCKPT_LORA_CONFIG``: ``LoraSettings``; ``SEGCKPT_GUARDRAILS``: ``GuardrailsConfig``;
``SEGCKPT_NOISE_SCHEDULE``: ``ObjectiveConfig``;
``SEGCKPT_TRAINING_RUN``: ``TrainResult``; and the three below. :class:`Sockets` holds them as V3
types (``io.Custom``), named as before, so saved workflows connect as they did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import api
from .v3 import io

CATEGORY = "training/gradient checkpointing"
MODEL, DATASET, SCHEDULE = "SEGCKPT_MODEL", "SEGCKPT_DATASET", "SEGCKPT_SCHEDULE"
OFFLOAD, LORA_CONFIG, RUN = "SEGCKPT_OFFLOAD", "SEGCKPT_LORA_CONFIG", "SEGCKPT_TRAINING_RUN"
GUARDRAILS, WEIGHT_OFFLOAD = "SEGCKPT_GUARDRAILS", "SEGCKPT_WEIGHT_OFFLOAD"
NOISE_SCHEDULE = "SEGCKPT_NOISE_SCHEDULE"


class Sockets:
    """The pack's socket types as V3 types: ``Sockets.model.Input("model")``, ``.Output(...)``."""

    model, dataset, schedule = io.Custom(MODEL), io.Custom(DATASET), io.Custom(SCHEDULE)
    offload, lora_config, run = io.Custom(OFFLOAD), io.Custom(LORA_CONFIG), io.Custom(RUN)
    guardrails, weight_offload = io.Custom(GUARDRAILS), io.Custom(WEIGHT_OFFLOAD)
    noise_schedule = io.Custom(NOISE_SCHEDULE)


@dataclass(frozen=True)
class ModelSource:
    """Which model Load Diffusion Model names (``SEGCKPT_MODEL``): each node that trains or measures
    on it loads its own copy (:meth:`load`) and drops it when it ends.

    ComfyUI keeps every node's output in its cache for the next queue. Were this the loaded model,
    the server would hold it after the run, and a training would hold a second copy of it while it
    runs (the loaded model is shared with other nodes; training injects its LoRA into a copy):
    after the Flux closed loop the pack's outputs held 4 GiB of the 8 GiB the server kept (issue 34).

    Attributes:
        config: the model's source, family, base precision and the preset's seed (``config.model``,
            ``config.seed``).
    """

    config: api.TrainConfig

    @property
    def family(self) -> api.FamilyAdapter:
        """The family's adapter."""
        return api.get_family(self.config.model.family)

    @property
    def base_precision(self) -> str:
        """The base precision chosen on the loader (``auto``, ``bf16``, ``int8-torchao``, ...)."""
        return self.config.model.base_model_precision

    def load(self) -> api.ModelBundle:
        """A new copy of the model, outside inference mode (ComfyUI runs nodes inside it).

        Raises:
            ModelLoadError: the folder or file cannot be used (named).
        """
        with torch.inference_mode(False):  # weights must not become inference tensors
            return api.load_model(self.config)


@dataclass(frozen=True)
class FamilySchedule:
    """A checkpoint schedule and the family it was checked for (``SEGCKPT_SCHEDULE``)."""

    family: str
    schedule: api.CheckpointSchedule


@dataclass(frozen=True)
class OffloadOptions:
    """The Activation Offload Options node's keys, which override a schedule's (``SEGCKPT_OFFLOAD``)."""

    gradient_checkpointing_backend: str
    gradient_checkpointing_offload_attention: bool
    gradient_checkpointing_offload_pin_memory_max_buckets: int

    def apply(self, schedule: api.CheckpointSchedule) -> api.CheckpointSchedule:
        """``schedule`` with these keys.

        Raises:
            ScheduleError: the combination is invalid.
        """
        return schedule.replace(**vars(self))


@dataclass(frozen=True)
class WeightOffload:
    """The Weight Offload Options node's keys, which override a schedule's (``SEGCKPT_WEIGHT_OFFLOAD``).

    Attributes:
        weight_offload: ``none`` or ``stream`` (frozen block weights in host memory).
        weight_offload_blocks: how many blocks stream; ``None`` = all of them.
        weight_offload_prefetch: streamed blocks (or segments) copied ahead, 0..8.
    """

    weight_offload: str
    weight_offload_blocks: int | None
    weight_offload_prefetch: int

    def apply(self, schedule: api.CheckpointSchedule) -> api.CheckpointSchedule:
        """``schedule`` with these keys (its checkpointing keys unchanged).

        Raises:
            ScheduleError: the combination is invalid (a block count with ``weight_offload=none``).
        """
        return schedule.replace(**vars(self))
