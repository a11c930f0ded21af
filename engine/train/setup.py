"""The set-up of a training run, in named stages, each a function of what the one before made:

1. :func:`load_model` - the :class:`~..model.bundle.ModelBundle` (a folder, one file or a preset);
2. ``prepare_data`` (:func:`~..data.prepare.prepare_run_data`) - the latent cache and the epoch;
3. :func:`build_trainable` - the frozen base at its precision, the fp32 LoRA, and the checkpoint
   schedule through :func:`apply_checkpointing` (the plan, the runner installed, then sharding);
4. :func:`build_optimizer` - the optimizer, the loss scaler, the noise generator and the sampler, restored
   from the saved state when resuming.

:func:`apply_checkpointing` is the one place that turns a schedule into a running plan; the
out-of-memory recovery (:mod:`.recovery`) installs a cheaper schedule through it too. The order
inside it follows torchtitan's ``parallelize`` functions: checkpointing first, then ``fully_shard``
on every block and the root (FSDP), or the ``DistributedDataParallel`` wrapper the runner calls (DDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import CheckpointSchedule, ConfigError, ShardingConfig, TrainConfig, derived_seed
from ..core.compiling import CompileReport, compile_blocks
from ..core.plan import count_blocks, effective_plan
from ..core.runner import SegmentRunner
from ..data.prepare import make_sampler
from ..data.samplers import EpochSampler
from ..families import FamilyAdapter
from ..model.bundle import ModelBundle
from ..model.distributed import Distributed, replicate, shard_model, shard_optimizer_state
from ..model.loading import load_bundle
from ..model.lora_files import add_lora, load_lora_file, load_lora_state_dict
from ..model.precision import BaseWeights, Precision, apply_base_precision, host_parameters, move_to
from .optim import load_optimizer_state, make_optimizer, optimizer_class
from .state import TrainingState, set_rng_state


def load_model(config: TrainConfig, precision: Precision, log: Callable[[str], None]) -> ModelBundle:
    """Stage 1: the model of ``config`` (see :func:`~..model.loading.load_bundle`).

    Raises:
        ModelLoadError: the folder or file cannot be used.
    """
    return load_bundle(config.model, config.seed, precision, log)


def streamed_modules(family: FamilyAdapter, model: torch.nn.Module, schedule: CheckpointSchedule) -> list[torch.nn.Module]:
    """The blocks whose frozen weights the plan of ``schedule`` streams (empty without streaming)."""
    if not schedule.streams:
        return []
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    return [family.blocks(model, bl)[i] for bl, lp in zip(family.block_lists, plan.lists) for i in lp.streamed]


def apply_checkpointing(model: torch.nn.Module, family: FamilyAdapter, schedule: CheckpointSchedule,
                        sharding: ShardingConfig | None = None, dist: Distributed | None = None) -> SegmentRunner:
    """Install ``schedule`` on ``model``: its effective plan (the family's rules applied; a
    streaming plan on the CPU notes that it saves no memory there), the segment runner as the model's checkpoint function, then, under FSDP, ``fully_shard`` on every
    block and the root (after the runner: FSDP's hooks sit on the blocks the runner calls), or
    under DDP the runner's :attr:`~..core.runner.SegmentRunner.entry` set to the model's
    ``DistributedDataParallel`` wrapper (``engine/model/distributed.py`` ``replicate``).

    Args:
        model: the training model (LoRA added, on its device).
        sharding: the run's sharding options (FSDP's own checkpointing makes the plan ``fsdp-layer``).
        dist: the process group of a multi-process run; ``None``: one process.

    Returns:
        The installed runner (its ``plan`` is the plan every entry point reports).
    """
    fsdp_checkpointing = sharding is not None and sharding.fsdp_activation_checkpointing
    device = next((p.device for p in model.parameters() if p.requires_grad), None)  # the LoRA's: the device's
    plan = effective_plan(family, schedule, count_blocks(family, model), fsdp_checkpointing=fsdp_checkpointing,
                          host_device=device is not None and device.type == "cpu")
    runner = SegmentRunner(model, family, plan).install()
    if dist is not None and dist.kind == "ddp":
        runner.entry = replicate(model)
    elif dist is not None:
        blocks = [block for bl in family.block_lists for block in family.blocks(model, bl)]
        shard_model(model, blocks, fsdp_checkpointing)
    return runner


@dataclass
class Trainable:
    """The model being trained (stage 3).

    Attributes:
        model: the transformer with its LoRA, on the device, in train mode (sharded under FSDP).
        runner: the installed :class:`~..core.runner.SegmentRunner`.
        params: the trainable LoRA parameters (DTensor shards under FSDP).
        base: what the base's precision did (frozen bytes, quantized layers).
        compiled: what ``compile_blocks`` compiled (``engine/core/compiling.py``), or None.
    """

    model: torch.nn.Module
    runner: SegmentRunner
    params: list[torch.nn.Parameter]
    base: BaseWeights
    compiled: CompileReport | None = None


def build_trainable(bundle: ModelBundle, config: TrainConfig, precision: Precision, device: torch.device,
                    state: TrainingState | None, dist: Distributed | None,
                    log: Callable[[str], None]) -> Trainable:
    """Stage 3: the frozen base at its precision (cast, or quantized layer by layer on the
    device), the fp32 LoRA (from ``init_lora``, or the saved state when resuming, loaded whole
    before sharding), then :func:`apply_checkpointing`.

    Raises:
        LoraConfigError: no module matches the LoRA targets; an ``init_lora`` of another shape.
    """
    model = bundle.transformer
    host = streamed_modules(bundle.family, model, config.schedule)  # their frozen weights stay on the host
    base = apply_base_precision(model, precision, device, host)
    # peft initialises lora_A from torch's global generator: seed it, or two runs with one
    # seed in one process (a ComfyUI server, a sweep) would start from different adapters
    torch.manual_seed(config.seed)
    add_lora(model, config.lora, bundle.family.lora_targets, bundle.family)
    if config.model.init_lora and state is None:
        log(f"init_lora: {load_lora_file(model, config.model.init_lora, config.lora, bundle.family.name)} modules from "
            f"{config.model.init_lora}")
    if state is not None:
        load_lora_state_dict(model, state.lora)
    move_to(model, device, host_parameters(host)).train()
    blocks = sum(count_blocks(bundle.family, model).values())
    runner = apply_checkpointing(model, bundle.family, config.schedule, config.sharding, dist)
    params = [p for p in model.parameters() if p.requires_grad]  # after sharding: DTensor shards
    if dist is not None:
        part, batch = config.data.batch_rows(dist.world_size)
        spread = (f"{blocks} blocks and the root sharded" if dist.kind == "fsdp"
                  else f"the LoRA ({sum(p.numel() for p in params)} parameters) replicated")
        log(f"{dist.kind}: {spread} over {dist.world_size} processes "
            f"({dist.backend}), {part} of the {batch} images of each batch per process"
            + (f"; on_oom=switch is not applied under {dist.kind} (the processes cannot retry a step together): a "
               "step that runs out of memory stops the run, its last good step saved"
               if config.guards.on_oom == "switch" else ""))
    compiled = None
    if config.model.compile_blocks:  # after the runner and sharding: the runner calls the compiled blocks
        compiled = compile_blocks(model, bundle.family, runner, quantized=base.quantized_linear_layers > 0)
        log(f"compile_blocks: {compiled.how}, {sum(map(len, compiled.compiled.values()))} blocks compiled at their "
            "first call (dynamic shapes)")
    return Trainable(model, runner, params, base, compiled)


@dataclass
class Optimization:
    """What updates the LoRA (stage 4), restored from the saved state when resuming.

    Attributes:
        optimizer: the configured optimizer over the trainable parameters. scaler: fp16 loss scaling (off otherwise).
        noise_gen: the generator of the noise and timesteps. sampler: the data's batches.
        start: the first step's index (0, or the steps already done). history: their records.
    """

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    noise_gen: torch.Generator
    sampler: Any
    start: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def build_optimizer(trainable: Trainable, config: TrainConfig, precision: Precision, device: torch.device,
                    cache: dict[str, torch.Tensor], epoch: list[int], state: TrainingState | None,
                    dist: Distributed | None) -> Optimization:
    """Stage 4: the optimizer, loss scaler, noise generator and sampler of the run; with ``state``,
    each restored where the saved run stopped (so a resumed run continues bit for bit).

    Raises:
        ConfigError: the optimizer's package is not installed; the saved optimizer state is another
            implementation's (torchao's AdamW8bit saved, bitsandbytes' here).
    """
    optimizer = make_optimizer(trainable.params, config.optimizer, device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
    noise_gen = torch.Generator().manual_seed(derived_seed(config.seed, 1))
    # every rank draws the global batch (same seed) and trains its rows of it (StepContext.dist)
    batch, seed = config.data.batch_rows(dist.world_size if dist is not None else 1)[1], config.seed
    sampler: EpochSampler | Any = make_sampler(cache, epoch, batch, seed, {})
    torch.manual_seed(seed)  # dropout and anything else drawing from the global RNG
    if state is None:
        return Optimization(optimizer, scaler, noise_gen, sampler)
    if state.optimizer_class and state.optimizer_class != optimizer_class(optimizer):
        raise ConfigError(f"resume: the saved optimizer state is {state.optimizer_class}'s, but optimizer="
                          f"{config.optimizer.name!r} is {optimizer_class(optimizer)} here; allowed the package the "
                          "saved run used (install it), or start a new run")
    sharded = dist is not None and dist.kind == "fsdp"  # a ddp rank holds the whole state, as one process
    load_optimizer_state(optimizer, shard_optimizer_state(state.optimizer, trainable.params) if sharded
                         else state.optimizer)
    if state.grad_scaler and scaler.is_enabled():
        scaler.load_state_dict(state.grad_scaler)
    set_rng_state(state.rng, noise_gen)
    sampler = make_sampler(cache, epoch, batch, seed, state.data_position)
    return Optimization(optimizer, scaler, noise_gen, sampler, state.step, state.history)
