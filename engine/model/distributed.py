"""Training on several processes under ``torchrun``: FSDP2 (``fully_shard``) or DDP
(``DistributedDataParallel`` over the LoRA), the process group, the sharding or replication of a
model, and what such a run needs to stay equal to a single-process one.

We do not build a distributed engine: PyTorch's does the work (FSDP2, ``torch.distributed``
collectives, ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``). This module wires
it to a :class:`~..train.loop.TrainingRun`:

- :func:`init_distributed` joins the process group ``torchrun`` describes (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA, gloo on the CPU.
- :func:`replicate` (``ddp``) wraps the model in ``DistributedDataParallel`` over its trainable
  (LoRA) parameters alone: every rank holds the whole frozen base (loaded alike; never broadcast),
  and DDP averages the LoRA gradients during backward. The segment runner calls the wrapper
  (non-reentrant checkpointing: DDP needs no ``static_graph``); non-final micro-batches of a
  gradient accumulation run under ``no_sync`` (:func:`sync_gradients`).
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
from torch.nn.parallel import DistributedDataParallel

WRAPPED_PREFIX = "_checkpoint_wrapped_module."
"""What ``checkpoint_wrapper`` inserts into parameter names (``torch.distributed.algorithms.
_checkpoint.checkpoint_wrapper._CHECKPOINT_PREFIX``); saved names leave it out."""
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
KINDS = ("fsdp", "ddp")
"""How a multi-process run spreads the model: FSDP2 shards it, DDP replicates it."""


class DistributedError(ValueError):
    """Sharded training cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class Distributed:
    """This process's place in a ``torchrun`` job.

    Attributes:
        rank: global rank (0 writes files and prints). world_size: number of processes.
        local_rank: rank on this machine (selects ``cuda:<local_rank>``).
        backend: ``nccl`` or ``gloo``. kind: ``fsdp`` or ``ddp`` (:data:`KINDS`).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    kind: str = "fsdp"

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
            raise DistributedError(f"batch_size={batch} is invalid with {self.kind} on {self.world_size} processes: "
                                   f"allowed a multiple of {self.world_size} (each rank trains batch/world rows)")
        part = batch // self.world_size
        return slice(self.rank * part, (self.rank + 1) * part)

    def share(self, batch: int) -> tuple[slice, float]:
        """This rank's rows of a global batch of ``batch`` rows and the factor of its loss, so that
        the ranks' averaged gradients are those of the whole batch's mean loss. Equal parts: factor 1.
        Under ``ddp`` a bucket's short batch (``engine/data/samplers.py`` ``BucketSampler``) splits
        unevenly, as ``numpy.array_split`` does (the first ``batch % world`` ranks one row more):
        a rank of ``n`` rows weighs its mean loss by ``n * world / batch``; a rank left without a
        row trains the batch's first row with factor 0 (DDP needs every rank's backward).

        Raises:
            DistributedError: an uneven ``batch`` under ``fsdp`` (:meth:`local_rows`).
        """
        if batch % self.world_size == 0 or self.kind != "ddp":
            return self.local_rows(batch), 1.0
        part, extra = divmod(batch, self.world_size)
        start = self.rank * part + min(self.rank, extra)
        count = part + (self.rank < extra)
        if count == 0:
            return slice(0, 1), 0.0
        return slice(start, start + count), count * self.world_size / batch

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


def check_launch(kind: str = "fsdp") -> None:
    """Refuse ``fsdp`` or ``ddp`` (``kind``) outside ``torchrun``, before any model is built (the
    ComfyUI node, one process, is refused here too).

    Raises:
        DistributedError: a ``torchrun`` variable is missing (named, with the launch command).
    """
    missing = [k for k in ENV_KEYS if k not in os.environ]
    if missing:
        raise DistributedError(
            f"{kind}=True needs the process group torchrun sets up ({', '.join(missing)} unset): launch with "
            f"torchrun --nproc-per-node N --no-python segckpt train --{kind} ... (docs/MULTI_GPU.md)")


def init_distributed(device_type: str, kind: str = "fsdp") -> Distributed:
    """Join the ``torchrun`` process group (once per process; later calls reuse it).

    Args:
        device_type: ``cuda`` (NCCL, one device per local rank) or ``cpu`` (gloo).
        kind: ``fsdp`` or ``ddp`` (:data:`KINDS`).

    Raises:
        DistributedError: not under ``torchrun``, or fewer CUDA devices than local ranks.
    """
    check_launch(kind)
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} has no CUDA device ({torch.cuda.device_count()} "
                                   "visible): allowed --nproc-per-node up to the number of GPUs")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if backend == "nccl" else None)
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), kind)


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


def replicate(model: torch.nn.Module) -> DistributedDataParallel:
    """``model`` wrapped in ``DistributedDataParallel`` over its trainable (LoRA) parameters: the
    frozen base and every buffer are left out (each rank loads them alike; streamed weights stay
    where the streamer keeps them), rank 0's LoRA is broadcast once, and gradients are averaged
    over ranks during backward. ``find_unused_parameters`` stays off: every LoRA parameter takes
    part in every forward. Call the wrapper, not ``model``, for each training forward.

    Args:
        model: the training model (LoRA added, on its device, the segment runner installed).

    Returns:
        The wrapper (``.module`` is ``model``).
    """
    ignored = [name for name, p in model.named_parameters() if not p.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignored + [name for name, _ in model.named_buffers()])
    return DistributedDataParallel(model)


def sync_gradients(entry: Any, sync: bool) -> contextlib.AbstractContextManager:
    """Around one micro-batch's forward and backward: DDP's ``no_sync`` when ``sync`` is False (a
    non-final micro-batch of a gradient accumulation: gradients accumulate locally and the final
    micro-batch's backward averages their sum); nothing otherwise or without DDP.

    Args:
        entry: what the segment runner calls (the model, or :func:`replicate`'s wrapper).
    """
    if sync or not isinstance(entry, DistributedDataParallel):
        return contextlib.nullcontext()
    return entry.no_sync()


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
