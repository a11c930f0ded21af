"""Sharded training with FSDP2 under torchrun (read by ``engine/model/distributed.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import ConfigError, check_options, option


@dataclass(frozen=True)
class ShardingConfig:
    """Whether and how the model is sharded. Validated at construction.

    Raises:
        ConfigError: a field is not a bool, or FSDP's checkpointing without FSDP.
    """

    fsdp: bool = option(False, "Shard the model with PyTorch FSDP2 (fully_shard on every block and the root; frozen "
                        "base and LoRA) over the processes torchrun starts: NCCL on CUDA, gloo on the CPU. batch_size "
                        "is per process (global_batch_size: over all processes); only rank 0 logs and writes, and the "
                        "LoRA and resumable state are saved whole (a single process can load them).", "--fsdp",
                        long_run=True)
    fsdp_activation_checkpointing: bool = option(
        False, "With fsdp: FSDP-style activation checkpointing (checkpoint_wrapper around every block) instead of "
        "the segmented schedule; the model-level schedule is then switched off, with a warning.",
        "--fsdp-activation-checkpointing", long_run=True)

    def __post_init__(self) -> None:
        check_options(self)
        if self.fsdp_activation_checkpointing and not self.fsdp:
            raise ConfigError("fsdp_activation_checkpointing=True is invalid: allowed false without fsdp (it is "
                              "FSDP's own checkpointing; set fsdp too).")
