"""Sharded training with PyTorch FSDP2 (``fully_shard``) under ``torchrun``: the process group,
the sharding of a model, and what a sharded run needs to stay equal to a single-process one.

We do not build a distributed engine: PyTorch's does the work (FSDP2, ``torch.distributed``
collectives, ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``). This module wires
it to a :class:`~..train.loop.TrainingRun`:

- :func:`init_distributed` joins the process group ``torchrun`` describes (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA, gloo on the CPU.
- :func:`shard_model` applies ``fully_shard`` to every block of every block list and then to the
  root (PyTorch's FSDP2 recipe: one all-gather per block, the rest at the root). Frozen base and
  LoRA parameters are both sharded. With FSDP-style activation checkpointing, every block is first
  wrapped by ``checkpoint_wrapper`` (non-reentrant) through ``apply_activation_checkpointing``.
- Data parallelism keeps the single-process arithmetic: ``batch_size`` is the batch of each
  process (as SimpleTuner's ``train_batch_size``, accelerate and kohya count it), so the global
  batch is ``batch_size`` x world size (or ``global_batch_size``, split evenly:
  :meth:`~..config.data.DataConfig.batch_rows`); every rank draws the same global batch, noise and
  timesteps (same seeds) and trains on its own rows (:meth:`Distributed.local_rows`); FSDP averages
  the gradients over ranks, so with equal rows per rank the update is that of one process training
  the global batch, up to summation order.
- :func:`full_tensor` and :func:`full_optimizer_state` gather DTensors (sharded LoRA weights,
  optimizer slots) into full tensors, so that the LoRA file and the resumable state a sharded run
  writes are those of a single-process run; :func:`shard_optimizer_state` turns such a state back
  into shards.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

WRAPPED_PREFIX = "_checkpoint_wrapped_module."
"""What ``checkpoint_wrapper`` inserts into parameter names (``torch.distributed.algorithms.
_checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX``); saved names leave it out."""
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(ValueError):
    """Sharded training cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class Distributed:
    """This process's place in a ``torchrun`` job.

    Attributes:
        rank: global rank (0 writes files and prints). world_size: number of processes.
        local_rank: rank on this machine (selects ``cuda:<local_rank>``).
        backend: ``nccl`` or ``gloo``.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def main(self) -> bool:
        """Rank 0: the one process that logs and writes."""
        return self.rank == 0

    def local_rows(self, batch: int) -> slice:
        """This rank's rows of a drawn global batch of ``batch`` rows (equal parts; the run draws
        :meth:`~..config.data.DataConfig.batch_rows`' global batch, which splits evenly).

        Raises:
            DistributedError: ``batch`` is not a multiple of the world size.
        """
        if batch % self.world_size:
            raise DistributedError(f"batch_size={batch} is invalid with fsdp on {self.world_size} processes: "
                                   f"allowed a multiple of {self.world_size} (each rank trains batch/world rows)")
        part = batch // self.world_size
        return slice(self.rank * part, (self.rank + 1) * part)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over ranks (a new tensor; SUM then divide: gloo has no AVG)."""
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def all_true(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise AND over ranks of 0/1 ``flags`` (MIN), so that every rank decides alike."""
        flags = flags.detach().clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags

    def barrier(self) -> None:
        """Wait until every rank is here."""
        dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (writes a cache, the sample photos), the others after it
        (they read what it wrote)."""
        if not self.main:
            dist.barrier()
        yield
        if self.main:
            dist.barrier()

    def to_dict(self) -> dict[str, Any]:
        """For ``report.json``."""
        return {"world_size": self.world_size, "backend": self.backend}


def check_launch() -> None:
    """Refuse ``fsdp`` outside ``torchrun``, before any model is built.

    Raises:
        DistributedError: a ``torchrun`` variable is missing (named, with the launch command).
    """
    missing = [k for k in ENV_KEYS if k not in os.environ]
    if missing:
        raise DistributedError(
            f"fsdp=True needs the process group torchrun sets up ({', '.join(missing)} unset): launch with "
            "torchrun --nproc-per-node N --no-python segckpt train --fsdp ... (README 'Several GPUs')")


def init_distributed(device_type: str) -> Distributed:
    """Join the ``torchrun`` process group (once per process; later calls reuse it).

    Args:
        device_type: ``cuda`` (NCCL, one device per local rank) or ``cpu`` (gloo).

    Raises:
        DistributedError: not under ``torchrun``, or fewer CUDA devices than local ranks.
    """
    check_launch()
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} has no CUDA device ({torch.cuda.device_count()} "
                                   "visible): allowed --nproc-per-node up to the number of GPUs")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if backend == "nccl" else None)
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend())


def close_distributed() -> None:
    """Leave the process group (at the end of a ``torchrun`` process; nothing when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_sharded_precision(precision, base_model_precision: str) -> None:
    """Refuse a precision whose fp16 loss scaling is not wired for sharded gradients (a
    ``no_change`` of fp16 weight files; ``fp16`` itself is refused by the config).

    Raises:
        DistributedError: naming ``base_model_precision`` and what runs sharded.
    """
    if precision.loss_scaling:
        raise DistributedError(f"base_model_precision={base_model_precision!r} trains with fp16 loss scaling here, "
                               "which is not wired for sharded gradients: allowed bf16 or fp32 with fsdp")


def shard_model(model: torch.nn.Module, blocks: list[torch.nn.Module], fsdp_checkpointing: bool) -> int:
    """Shard ``model`` with FSDP2: ``fully_shard`` on each of ``blocks``, then on the root.

    Args:
        model: the training model (LoRA added, on its device, the runner installed).
        blocks: every block of every block list, in forward order.
        fsdp_checkpointing: first wrap each block in ``checkpoint_wrapper`` (non-reentrant
            ``torch.utils.checkpoint``) through ``apply_activation_checkpointing``: FSDP-style
            per-block activation checkpointing (the model-level schedule must be off).

    Returns:
        The number of blocks sharded on their own.
    """
    ids = {id(block) for block in blocks}
    units = list(blocks)
    if fsdp_checkpointing:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda module: id(module) in ids)
        # the wrappers now stand where the blocks were: they are the units to shard
        units = [m for m in model.modules() if id(getattr(m, "_checkpoint_wrapped_module", None)) in ids]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return len(units)


def plain_name(name: str) -> str:
    """A parameter name without ``checkpoint_wrapper``'s prefix (the single-process name)."""
    return name.replace(WRAPPED_PREFIX, "")


def full_tensor(value: Any) -> Any:
    """A DTensor gathered into a full tensor (a collective: every rank must call it); other
    values unchanged."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor unchanged."""
    return value.to_local() if isinstance(value, DTensor) else value


def full_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` of sharded parameters with full tensors: the state dict a
    single-process run holds (same parameter order). Collective."""
    return {"state": {index: {name: full_tensor(value) for name, value in slots.items()}
                      for index, slots in state["state"].items()},
            "param_groups": state["param_groups"]}


def shard_optimizer_state(state: Mapping[str, Any], params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """A full (single-process) optimizer state dict cut into this rank's shards: every slot with
    the shape of its parameter becomes a DTensor placed like the parameter (``step`` stays).

    Args:
        state: ``{"state": {index: {slot: tensor}}, "param_groups": [...]}``.
        params: the optimizer's parameters in order (sharded DTensors).
    """
    out: dict[int, dict[str, Any]] = {}
    for index, slots in state["state"].items():
        param = params[int(index)]
        out[index] = {}
        for name, value in slots.items():
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            out[index][name] = value
    return {"state": out, "param_groups": state["param_groups"]}
