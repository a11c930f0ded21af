"""The set-up of a training run, in named stages, each a function of what the one before made:

0. :func:`open_site` (the run's constructor, before any model is built) - the :class:`RunSite`:
   device, process group, precision, SDPA kernels and the output folder's lock;
1. ``load_model`` (:func:`~..model.loading.load_bundle`) - the :class:`~..model.bundle.ModelBundle`
   (a folder, one file or a preset);
2. :func:`prepare_data` (:func:`~..data.prepare.prepare_run_data`) - the latent cache and the epoch;
3. :func:`build_trainable` - the frozen base at its precision, the fp32 LoRA, and the checkpoint
   schedule through :func:`apply_checkpointing` (the plan, the runner installed, then sharding);
4. :func:`build_optimizer` - the optimizer, the loss scaler, the noise generator and the sampler, restored
   from the saved state when resuming;
5. :func:`step_context` - what every step uses, made of the above.

:func:`apply_checkpointing` is the one place that turns a schedule into a running plan; the
out-of-memory recovery (:mod:`.recovery`) installs a cheaper schedule through it too. The order
inside it follows torchtitan's ``parallelize`` functions: checkpointing first, then ``fully_shard``
on every block and the root (FSDP), or the ``DistributedDataParallel`` wrapper the runner calls (DDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import (
    CheckpointSchedule,
    ConfigError,
    DataConfig,
    GuardrailsConfig,
    LoraSettings,
    ModelConfig,
    OptimizerConfig,
    ShardingConfig,
    TrainConfig,
    ValidationConfig,
    derived_seed,
)
from ..core.compiling import CompileReport, compile_blocks
from ..core.memory import PeakMemory, StepTimer, free_memory
from ..core.plan import count_blocks, effective_plan
from ..core.runner import SegmentRunner
from ..data.buckets import sample_latent_shape, shape_classes
from ..data.comfy_data import PreparedData
from ..data.prepare import RunData, make_sampler, prepare_run_data, prepared_run_data
from ..data.samplers import EpochSampler, batch_over_data, describe_batch_over_data
from ..families import FamilyAdapter
from ..files.atomic import check_writable
from ..files.lock import FolderLock
from ..model.attention_kernels import check_attention_backend
from ..model.bundle import ModelBundle
from ..model.distributed import (
    Distributed,
    check_sharded_precision,
    init_distributed,
    plain_name,
    replicate,
    shard_model,
    shard_optimizer_state,
)
from ..model.loading import load_bundle, resolve_device, run_precision
from ..model.lora_files import add_lora, load_lora_file, load_lora_state_dict
from ..model.precision import BaseWeights, Precision, apply_base_precision, check_torchao, host_parameters, move_to
from .monitor import StepMonitor
from .objectives import NoiseSchedule
from .optim import load_optimizer_state, make_optimizer, optimizer_class
from .previews import PreviewSource, preview_source_for
from .state import TrainingState, set_rng_state
from .step import StepContext

NextSchedule = Callable[[CheckpointSchedule, Any], "CheckpointSchedule | None"]
"""``(schedule, family) -> the schedule to switch to after an out-of-memory step, or None``."""


@dataclass
class RunInputs:
    """What a caller gives a run besides its config (``TrainingRun``'s keyword arguments).

    Attributes:
        bundle: an already loaded model (its transformer gets the adapter and the run's base
            precision: pass a copy when it is shared); default: loaded at the first step.
        cache_dir: folder of the latent cache (default ``<output>/cache``), shareable by runs.
        prepared: latents and text a caller prepared (ComfyUI's LATENT and CONDITIONING,
            ``engine/data/comfy_data.py``) instead of an image folder (``data`` then unset).
        preview_source: what validation previews sample from (default: the validation prompts
            through the bundle's text encoder, decoded by its VAE).
        next_schedule: the schedule to switch to after an out-of-memory step with
            ``on_oom=switch`` (default :func:`~.recovery.first_cheaper`; the pre-flight's own).
        rows: train on these cache rows only (a probe of one bucket); default: every sample.
        announce: warn when captions go through the stand-in embedder (measurement runs do not).
    """

    bundle: ModelBundle | None = None
    cache_dir: str | Path | None = None
    prepared: PreparedData | None = None
    preview_source: PreviewSource | None = None
    next_schedule: NextSchedule | None = None
    rows: list[int] | None = None
    announce: bool = True


@dataclass
class RunProgress:
    """Where a run's iteration stands: ``started`` (it can run once), ``stop`` (asked to end after
    the current step), ``done`` (steps done; None before the first), ``start`` (the first step's index)."""

    started: bool = False
    stop: bool = False
    done: int | None = None
    start: int = 0


@dataclass
class RunSite:
    """Where a run runs and writes (stage 0).

    Attributes:
        output: the output folder. cache_dir: the latent cache's folder.
        device: the training device (a rank's own GPU under torchrun).
        precision: the run's :class:`~..model.precision.Precision`. kernels: the SDPA kernels it may use.
        log: where progress lines go (ranks other than 0 stay quiet).
        dist: the process group of a multi-process run (FSDP, DDP); None: one process.
        lock: the output folder's lock (None on the ranks that write nothing).
    """

    output: Path
    cache_dir: Path
    device: torch.device
    precision: Precision
    kernels: tuple[str, ...]
    log: Callable[[str], None]
    dist: Distributed | None = None
    lock: FolderLock | None = None

    @property
    def writer(self) -> bool:
        """Whether this process writes files (one process, or rank 0 of a multi-process run)."""
        return self.dist is None or self.dist.main

    @property
    def world_size(self) -> int:
        """The processes that share each batch (1: one process)."""
        return self.dist.world_size if self.dist is not None else 1


def open_site(model: ModelConfig, sharding: ShardingConfig, data: DataConfig, output: Path,
              cache_dir: Path | None, log: Callable[[str], None]) -> RunSite:
    """Stage 0: join the torchrun process group (``sharding``), resolve the device, the precision and
    the SDPA kernels, and take the output folder's lock once both folders can be written.

    Raises:
        ConfigError, PrecisionError, AttentionBackendError: an option cannot run here.
        OutputWriteError: the output or cache folder cannot be written. FolderInUseError: another
            run holds the output folder.
    """
    device, dist = resolve_device(model), None
    if sharding.kind:
        dist = init_distributed(device.type, sharding.kind)
        if device.type == "cuda":
            device = torch.device("cuda", dist.local_rank)
        if not dist.main:
            log = _quiet
        data.batch_rows(dist.world_size)  # refuses a global batch that does not split evenly
    precision = run_precision(model, device)
    if dist is not None and dist.kind == "fsdp":
        check_sharded_precision(precision, model.base_model_precision)
    check_torchao(precision.base)
    kernels = check_attention_backend(model.attention_backend, device)
    site = RunSite(output, Path(cache_dir) if cache_dir else output / "cache", device, precision, kernels, log, dist)
    if site.writer:  # a folder that cannot be written is found before any model is built
        check_writable(site.output, "output")
        check_writable(site.cache_dir, "cache_dir")
        site.lock = FolderLock(site.output, "training")
    return site


def _quiet(line: str) -> None:
    """The log of ranks other than 0 of a multi-process run."""


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


def build_trainable(bundle: ModelBundle, site: RunSite, model_config: ModelConfig, lora: LoraSettings,
                    schedule: CheckpointSchedule, sharding: ShardingConfig, seed: int,
                    state: TrainingState | None) -> Trainable:
    """Stage 3: the frozen base at its precision (cast, or quantized layer by layer on the
    device), the fp32 LoRA (from ``init_lora``, or the saved state when resuming, loaded whole
    before sharding), then :func:`apply_checkpointing`.

    Raises:
        LoraConfigError: no module matches the LoRA targets; an ``init_lora`` of another shape.
    """
    model, family, log = bundle.transformer, bundle.family, site.log
    host = streamed_modules(family, model, schedule)  # their frozen weights stay on the host
    base = apply_base_precision(model, site.precision, site.device, host)
    # peft initialises lora_A from torch's global generator: seed it, or two runs with one
    # seed in one process (a ComfyUI server, a sweep) would start from different adapters
    torch.manual_seed(seed)
    add_lora(model, lora, family.lora_targets, family)
    if model_config.init_lora and state is None:
        log(f"init_lora: {load_lora_file(model, model_config.init_lora, lora, family.name)} modules from "
            f"{model_config.init_lora}")
    if state is not None:
        load_lora_state_dict(model, state.lora)
    move_to(model, site.device, host_parameters(host)).train()
    runner = apply_checkpointing(model, family, schedule, sharding, site.dist)
    params = [p for p in model.parameters() if p.requires_grad]  # after sharding: DTensor shards
    compiled = None
    if model_config.compile_blocks:  # after the runner and sharding: the runner calls the compiled blocks
        compiled = compile_blocks(model, family, runner, quantized=base.quantized_linear_layers > 0)
        log(f"compile_blocks: {compiled.how}, {sum(map(len, compiled.compiled.values()))} blocks compiled at their "
            "first call (dynamic shapes)")
    return Trainable(model, runner, params, base, compiled)


def describe_processes(trainable: Trainable, family: FamilyAdapter, dist: Distributed, data: DataConfig,
                       guards: GuardrailsConfig) -> str:
    """The line a multi-process run logs after stage 3: how the model is spread over the processes
    and how each batch is split (and that ``on_oom=switch`` is not applied there)."""
    part, batch = data.batch_rows(dist.world_size)
    blocks = sum(count_blocks(family, trainable.model).values())
    spread = (f"{blocks} blocks and the root sharded" if dist.kind == "fsdp"
              else f"the LoRA ({sum(p.numel() for p in trainable.params)} parameters) replicated")
    return (f"{dist.kind}: {spread} over {dist.world_size} processes "
            f"({dist.backend}), {part} of the {batch} images of each batch per process"
            + (f"; on_oom=switch is not applied under {dist.kind} (the processes cannot retry a step together): a "
               "step that runs out of memory stops the run, its last good step saved"
               if guards.on_oom == "switch" else ""))


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


def build_optimizer(trainable: Trainable, optim: OptimizerConfig, batch_size: int, seed: int, site: RunSite,
                    cache: dict[str, torch.Tensor], epoch: list[int], state: TrainingState | None) -> Optimization:
    """Stage 4: the optimizer, loss scaler, noise generator and sampler of the run (``batch_size``:
    the global batch); with ``state``, each restored where the saved run stopped (so a resumed run
    continues bit for bit).

    Raises:
        ConfigError: the optimizer's package is not installed; the saved optimizer state is another
            implementation's (torchao's AdamW8bit saved, bitsandbytes' here).
    """
    device, dist = site.device, site.dist
    optimizer = make_optimizer(trainable.params, optim, device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=site.precision.loss_scaling)
    noise_gen = torch.Generator().manual_seed(derived_seed(seed, 1))
    # every rank draws the global batch (same seed) and trains its rows of it (StepContext.dist)
    sampler: EpochSampler | Any = make_sampler(cache, epoch, batch_size, seed, {})
    torch.manual_seed(seed)  # dropout and anything else drawing from the global RNG
    if state is None:
        return Optimization(optimizer, scaler, noise_gen, sampler)
    if state.optimizer_class and state.optimizer_class != optimizer_class(optimizer):
        raise ConfigError(f"resume: the saved optimizer state is {state.optimizer_class}'s, but optimizer="
                          f"{optim.name!r} is {optimizer_class(optimizer)} here; allowed the package the "
                          "saved run used (install it), or start a new run")
    sharded = dist is not None and dist.kind == "fsdp"  # a ddp rank holds the whole state, as one process
    load_optimizer_state(optimizer, shard_optimizer_state(state.optimizer, trainable.params) if sharded
                         else state.optimizer)
    if state.grad_scaler and scaler.is_enabled():
        scaler.load_state_dict(state.grad_scaler)
    set_rng_state(state.rng, noise_gen)
    sampler = make_sampler(cache, epoch, batch_size, seed, state.data_position)
    return Optimization(optimizer, scaler, noise_gen, sampler, state.step, state.history)


def prepare_data(data: DataConfig, model: ModelConfig, seed: int, site: RunSite, inputs: RunInputs) -> RunData:
    """Stage 2: the run's cache (latents, text; encoded once, or read from the latent cache) and the
    cache row of each position of an epoch (:func:`~..data.prepare.prepare_run_data`), with what a
    batch larger than the data does (``engine/data/samplers.py``) logged and kept in the summary
    (``report.json`` ``dataset.batch_over_data``); with ``inputs.rows`` (a probe of one bucket) the
    epoch holds those rows only. Loads the model into ``inputs.bundle`` when the run was given none
    (its VAE and text encoders encode the data).

    Raises:
        ModelLoadError, DatasetError, ComfyDataError: the model or the data cannot be used.
        ConfigError: ``rows`` that are none of the cache's.
    """
    inputs.bundle = inputs.bundle or load_bundle(model, seed, site.precision, site.log)
    run_data = (prepared_run_data(inputs.prepared, inputs.bundle, site.log) if inputs.prepared is not None else
                prepare_run_data(data, model, seed, inputs.bundle, site.cache_dir, site.output, site.log, inputs.announce))
    over = batch_over_data(run_data.cache, run_data.epoch, data.batch_rows(site.world_size)[1])
    if over is not None:  # said, and counted in report.json dataset.batch_over_data
        run_data.summary = {**run_data.summary, "batch_over_data": over}
        site.log(describe_batch_over_data(over))
    if inputs.rows is not None:
        run_data.epoch = [row for row in run_data.epoch if row in set(inputs.rows)]
        if not run_data.epoch:
            raise ConfigError(f"rows={sorted(inputs.rows)[:8]} is invalid: allowed rows of the data's cache")
    return run_data


def device_free(site: RunSite) -> int | None:
    """The device memory free before the run takes any, bytes (``report.json``
    ``memory.device_free_bytes_at_start``; logged); None on the CPU."""
    free = free_memory(site.device) if site.device.type == "cuda" else None
    if free is not None:
        site.log(f"device memory free at start: {free / 2**30:.3g} GiB")
    return free


def start_monitor(validation: ValidationConfig, guards: GuardrailsConfig, warmup_steps: int, frame_rate: float | None,
                  site: RunSite, inputs: RunInputs, data: RunData, cache: dict[str, torch.Tensor]) -> StepMonitor:
    """The monitor of a run's steps (:class:`~.monitor.StepMonitor`), with the previews' source
    (:func:`~.previews.preview_source_for`) when validation previews are due."""
    source = inputs.preview_source
    if validation.validation_every and (site.writer or site.dist.kind == "fsdp"):  # ddp: rank 0's own
        caption = data.dataset.samples[0].caption if data.dataset is not None and data.dataset.samples else ""
        source = preview_source_for(validation, frame_rate, inputs.bundle, sample_latent_shape(cache), site.device,
                                    source, caption, site.log)
    return StepMonitor(guards, warmup_steps, site.device, site.output, source, site.log, site.writer)


def step_context(config: TrainConfig, bundle: ModelBundle, trainable: Trainable, opt: Optimization, site: RunSite,
                 data: RunData) -> StepContext:
    """Stage 5: what every step of the run uses, made of the stages before, with the noise
    schedule's shift of every bucket resolved before the first draw."""
    runner = trainable.runner
    context = StepContext(
        config, trainable.model, bundle.family, runner, opt.optimizer, opt.scaler, opt.sampler, data.cache,
        opt.noise_gen, site.device, site.precision, site.kernels,
        PeakMemory(site.device, exclude=runner.pool.is_host if runner.pool else None,
                   compiled=trainable.compiled is not None),
        StepTimer(site.device, warmup=config.timing_warmup_steps),
        [(plain_name(n), p) for n, p in trainable.model.named_parameters() if p.requires_grad], data.epoch,
        dist=site.dist, random_windows=data.random_windows, compiled=trainable.compiled, empty_text=data.empty_text,
        noise=NoiseSchedule(bundle.family, config.objective, bundle.inference_shift, dict(bundle.transformer.config)))
    for shape, _rows in shape_classes(data.cache):
        context.noise.shift_for(shape)
    return context
