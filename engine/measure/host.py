"""Host memory in the plan: the host budget (``--host-budget``) and the host bytes a streamed
schedule needs, known before any model is built.

Weight streaming (docs/STREAMING.md) keeps one host copy of every streamed block's frozen
weights; offloaded activations wait in host memory too. The planner counts both against the host
budget as allocated (the weights' host arena chunks, engine/core/arena.py, not the tensors' bytes
alone); :func:`check_host_budget` refuses a run that asks for more streaming than the host holds
before a weight is read, from the model's config alone (the class is instantiated on the ``meta``
device: no memory is allocated, no file but ``config.json`` or a single file's header is read).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from ..config import ModelConfig
from ..config.guardrails import check_budget
from ..config.schedule import CheckpointSchedule
from ..core.arena import plan_chunks
from ..core.memory import device_budget, free_memory
from ..core.plan import count_blocks, effective_plan
from ..families import get_family
from ..model.folders import transformer_folder
from ..model.loading import resolve_device, run_precision
from ..model.single_file import identify_file, quantized_weight_bytes

HOST_MARGIN = 0.10
"""The default host budget leaves this share of the available host memory free (the OS, the
data loader, the pinned-memory bookkeeping)."""


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (``taskset``, a container's
    cpuset), bounded by a cgroup v2 CPU quota (``docker --cpus``, ``/sys/fs/cgroup/cpu.max``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


class HostBudgetError(ValueError):
    """The host budget is invalid or smaller than what the schedule keeps in host memory."""


def host_budget_bytes(value: str | float | None = None, key: str = "host_budget") -> int:
    """The host budget in bytes: a number of GiB, ``free`` (the host's available memory now),
    ``device`` (its total memory), or by default the available memory less :data:`HOST_MARGIN`.

    Raises:
        HostBudgetError: not a budget; the message names ``key``, the value and what is allowed.
    """
    if value is None:
        return int(free_memory("cpu") * (1 - HOST_MARGIN))
    try:
        checked = check_budget(value, key)
    except ValueError as exc:
        raise HostBudgetError(str(exc).replace("its total memory", "the host's total memory")) from None
    if isinstance(checked, str):
        return free_memory("cpu") if checked == "free" else device_budget("cpu")
    return int(checked * 2**30)


def streamed_bytes_estimate(model: ModelConfig, schedule: CheckpointSchedule) -> int | None:
    """Host bytes of the frozen weights of ``model`` that ``schedule`` streams (:func:`streamed_sizes`)."""
    sizes = streamed_sizes(model, schedule)
    return None if sizes is None else sum(sizes)


def streamed_host_bytes(model: ModelConfig, schedule: CheckpointSchedule) -> int | None:
    """Host bytes a streamed run allocates for its weights: the chunks the host arena plans for
    :func:`streamed_sizes` (engine/core/arena.py :func:`~..core.arena.plan_chunks`), the same plan the run makes.
    What the host budget counts. None when the model's files cannot tell."""
    sizes = streamed_sizes(model, schedule)
    return None if sizes is None else sum(plan_chunks(sizes))


def streamed_sizes(model_cfg: ModelConfig, schedule: CheckpointSchedule) -> list[int] | None:
    """Host bytes of each frozen tensor of ``model_cfg``'s model that ``schedule`` streams, from the model's config
    on the ``meta`` device at the run's storage precision (a quantized base: 1 byte per weight
    plus a 4-byte scale and, for int8, a 1-byte zero point per output row, as torchao stores them).

    A single file's config is read from its header (:func:`~..model.single_file.identify_file`);
    a GGUF file's quantized Linear weights count their stored bytes (they stream as stored), a
    scaled fp8 file's weights the storage dtype's (they are dequantized as read).

    Returns:
        The bytes of each tensor in the order the run holds them ([] without streaming), or None when the model's files cannot tell (the run's own
        checks name what is wrong with them).
    """
    if not schedule.streams:
        return []
    family = get_family(model_cfg.family)
    stored: dict[str, int] = {}
    if model_cfg.model_file:
        try:
            values = identify_file(model_cfg.model_file, family.name).config
            stored = quantized_weight_bytes(model_cfg.model_file, family.name)
        except (OSError, ValueError):
            return None
    elif model_cfg.model_path:
        try:
            values = family.model_cls().load_config(str(transformer_folder(model_cfg.model_path)))
        except (OSError, ValueError):
            return None  # the run's own checks name what is wrong with the folder
    else:
        values = dict(family.tiny_config)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family.model_cls().from_config(values) if model_cfg.model_path or model_cfg.model_file \
            else family.model_cls()(**values)
    precision = run_precision(model_cfg, resolve_device(model_cfg))
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    names = {id(m): n for n, m in model.named_modules()}
    blocks = {(li, bi): family.blocks(model, bl)[bi] for li, bl in enumerate(family.block_lists)
              for bi in plan.lists[li].streamed}
    return [size for unit in plan.stream_units() for key in unit
            for size in _block_sizes(blocks[key], precision, names, stored)]


def _block_sizes(block: torch.nn.Module, precision, names: dict[int, str], stored: dict[str, int]) -> list[int]:
    """Host bytes of each of ``block``'s weight tensors: ``stored`` bytes for a GGUF file's quantized
    Linear weights (``{model key: bytes}``), torchao's layout for a quantized precision (data, a 4-byte
    scale per row, for int8 a 1-byte zero point per row), else the storage dtype's."""
    sizes = []
    for module in block.modules():
        for name, param in module.named_parameters(recurse=False):
            key = f"{names[id(module)]}.{name}"
            if key in stored and isinstance(module, torch.nn.Linear):
                sizes.append(stored[key])
            elif precision.quantized and isinstance(module, torch.nn.Linear) and name == "weight":
                rows = param.shape[0]
                sizes += [param.numel(), rows * 4] + ([rows] if precision.base == "int8-torchao" else [])
            else:
                sizes.append(param.numel() * (precision.storage_dtype.itemsize if param.is_floating_point()
                                              else param.element_size()))
    return sizes


def check_host_budget(model: ModelConfig, schedule: CheckpointSchedule, budget_bytes: int,
                      value: str | float | None = None) -> int | None:
    """Refuse, before any model is built, a streamed ``schedule`` of ``model`` whose host copies exceed
    the host budget, counted as allocated: the host arena's chunks (:func:`streamed_host_bytes`).

    Returns:
        The host bytes the streamed weights' chunks take (None when unknown before the weights are read).

    Raises:
        HostBudgetError: in one line naming ``host_budget``, the value and the bytes needed.
    """
    needed = streamed_host_bytes(model, schedule)
    if needed is not None and needed > budget_bytes:
        shown = value if value is not None else f"default ({budget_bytes / 2**30:.4g} GiB)"
        raise HostBudgetError(
            f"host_budget={shown} is too small: weight_offload=stream ({schedule.mode}) keeps "
            f"{needed} bytes ({needed / 2**30:.4g} GiB) of frozen weights in host memory (as allocated: the chunks "
            f"holding them); allowed a host budget of at least that, or fewer streamed blocks (weight_offload_blocks)")
    return needed
