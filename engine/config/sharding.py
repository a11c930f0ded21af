"""Training on several processes under torchrun, FSDP2 or DDP (read by ``engine/model/distributed.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import ConfigError, check_options, option


@dataclass(frozen=True)
class ShardingConfig:
    """Whether and how the model is spread over processes. Validated at construction.

    Raises:
        ConfigError: a field is not a bool; FSDP's checkpointing without FSDP; ``ddp`` with ``fsdp``.
    """

    fsdp: bool = option(False, "Shard the model with PyTorch FSDP2 (fully_shard on every block and the root; frozen "
                        "base and LoRA) over the processes torchrun starts: NCCL on CUDA, gloo on the CPU. batch_size "
                        "is per process (global_batch_size: over all processes); only rank 0 logs and writes, and the "
                        "LoRA and resumable state are saved whole (a single process can load them).", "--fsdp",
                        long_run=True)
    ddp: bool = option(False, "Data parallel with PyTorch DDP (DistributedDataParallel over the LoRA parameters; "
                       "every process holds the whole frozen base, streamed or offloaded as on one process) over the "
                       "processes torchrun starts: NCCL on CUDA, gloo on the CPU. The faster choice for LoRA when a "
                       "replica fits one device (docs/MULTI_GPU.md; segckpt plan --nproc N predicts which). "
                       "batch_size is per process "
                       "(global_batch_size: over all processes); only rank 0 logs, writes and samples previews; "
                       "any number of processes resumes the state.", "--ddp", long_run=True)
    fsdp_activation_checkpointing: bool = option(
        False, "With fsdp: FSDP-style activation checkpointing (checkpoint_wrapper around every block) instead of "
        "the segmented schedule; the model-level schedule is then switched off, with a warning.",
        "--fsdp-activation-checkpointing", long_run=True)

    def __post_init__(self) -> None:
        check_options(self)
        if self.ddp and self.fsdp:
            raise ConfigError("ddp=True is invalid: allowed false with fsdp=True (one of them: ddp replicates the "
                              "model on every process, fsdp shards it; docs/MULTI_GPU.md).")
        if self.fsdp_activation_checkpointing and not self.fsdp:
            raise ConfigError("fsdp_activation_checkpointing=True is invalid: allowed false without fsdp (it is "
                              "FSDP's own checkpointing; set fsdp too).")

    @property
    def kind(self) -> str | None:
        """``fsdp``, ``ddp`` or None (one process)."""
        return "fsdp" if self.fsdp else "ddp" if self.ddp else None
