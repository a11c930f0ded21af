"""What the pack's nodes pass to each other: one dataclass (or engine object) per socket type.

``SEGCKPT_MODEL``: the engine's ``ModelBundle``; ``SEGCKPT_DATASET``: its ``DataConfig``;
``SEGCKPT_LORA_CONFIG``: ``LoraSettings``; ``SEGCKPT_GUARDRAILS``: ``GuardrailsConfig``;
``SEGCKPT_TRAINING_RUN``: ``TrainResult``; and the two below.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import api

CATEGORY = "training/gradient checkpointing"
MODEL, DATASET, SCHEDULE = "SEGCKPT_MODEL", "SEGCKPT_DATASET", "SEGCKPT_SCHEDULE"
OFFLOAD, LORA_CONFIG, RUN = "SEGCKPT_OFFLOAD", "SEGCKPT_LORA_CONFIG", "SEGCKPT_TRAINING_RUN"
GUARDRAILS = "SEGCKPT_GUARDRAILS"


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


class AnyType(str):
    """A type that matches any input (ComfyUI compares types with ``!=``): lets Save LoRA's file name
    feed a LoRA loader's ``lora_name``, so the file trained in this graph is the one applied."""

    def __ne__(self, other: object) -> bool:
        return False
