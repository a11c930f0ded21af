"""``segckpt``: the command line.

``segckpt train`` with no option runs the built-in default (the Flux tiny preset on sample
photographs, interval 2, stride 4, 20 steps). Every option overrides the same key of
``--config FILE.json``, which overrides the defaults. Options are validated before any model is
built; an invalid one exits with status 2 and a message naming the key, the value and what is
allowed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Sequence

# What torchao and diffusers log about torchao itself on import whenever it is installed (kernels
# built for other torch builds, torchao-serialized checkpoints) concerns nothing this command does;
# set before any engine import (peft imports torchao) so that it never reaches the console. The facade
# imports torch, diffusers and peft only when a command builds a model: --help, options, families and
# a refused option answer without them (tests/test_startup.py).
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from .engine import api

SCHEDULE_GROUP = "schedule"
"""The options of ``CheckpointSchedule``: ``train`` and ``plan --check`` take them, ``sweep`` runs every mode."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one ``segckpt: error:`` line (exit status 2) instead of
    the usage text and a ``segckpt train: error:`` line: ``--lr abc`` reads ``argument --lr: invalid
    float value: 'abc' (segckpt train --help lists the options)``."""

    def error(self, message: str):
        command = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        print(f"segckpt: error: {message} (segckpt {command}--help lists the options)", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        """A subcommand (``segckpt plan``) refuses what it does not know itself, first, so that its
        own help is named: ``plan --steps 2`` reads ``unrecognized arguments: --steps 2 (segckpt plan
        --help lists the options)``, not the top-level help nor a missing ``--budget``."""
        if " " not in self.prog:  # the top level: the subcommand's parser answers for its arguments
            return super().parse_known_args(args, namespace)
        required = [action for action in self._actions if action.required]
        for action in required:  # unknown arguments first: argparse would name a missing one before them
            action.required = False
        try:
            extras = super().parse_known_args(list(args or ()), None)[1]
        finally:
            for action in required:
                action.required = True
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return super().parse_known_args(args, namespace)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="segckpt", description="Segmented gradient checkpointing for "
                     "LoRA training of diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="Train a LoRA (no options: the built-in default).",
                           description="Train a LoRA with segmented gradient checkpointing.")
    _add_options(train)
    families = sub.add_parser("families", help="Print the support matrix (generated from the family adapters).")
    families.add_argument("--limits", action="store_true", default=False,
                          help="Also the model limits table (largest grid, frames, text per family), read from the "
                               "diffusers classes' default configs (imports them): docs/FAMILIES.md is this output.")
    sub.add_parser("options", help="Print README's options table (generated from the options' metadata).")
    sub.add_parser("recipes", help="Print docs/RECIPES.md: each family's default recipe and the peers' defaults "
                                   "(imports diffusers: the families' model configs).")
    sweep = sub.add_parser("sweep", help="Measure every checkpointing mode on one model (sec/step / peak GiB).",
                           description="Run each mode (none, layer, interval 2, interval 2 stride 4; every backend "
                                       "and attention offload the family supports) for a few steps after warm-up "
                                       "and write sweep.md, sweep.csv, sweep.json and sweep.png into --output.")
    _add_options(sweep, "Folder for sweep.md, sweep.csv, sweep.json and sweep.png (default output/sweep).",
                 schedule=False)
    plan = sub.add_parser("plan", help="Pick the fastest schedule predicted to fit a memory budget.",
                          description="Probe one step without checkpointing (per-block activation bytes and "
                                      "time), predict every candidate schedule's peak and sec/step, and print "
                                      "the fastest one that fits --budget; with --measure N, time it and up to two "
                                      "other fitting candidates head to head (lockstep) and keep the fastest "
                                      "measured one that fits.")
    _add_options(plan, "Folder for plan.txt and schedule.json (default output/plan).")
    plan.add_argument("--budget", dest="plan_budget", required=True,
                      help="Memory budget in GiB, or 'device' (fit this device's memory).")
    plan.add_argument("--host-budget", dest="plan_host_budget", default=None,
                      help="Host memory for streamed weights and offloaded activations, GiB, 'free' (the host's "
                           "available memory now) or 'device' (its total memory); default: the available memory "
                           "less 10%%.")
    plan.add_argument("--levers", dest="plan_levers", nargs="+", default=(), choices=("save_attention", "compile"),
                      help="After the choice is measured, measure it with each lever (save_attention: "
                           "gradient_checkpointing_save_attention; compile: compile_blocks) and keep one only when "
                           "it is faster within the budget; the plan output says which and why.")
    plan.add_argument("--measure", dest="plan_measure", type=int, default=3,
                      help="Steps to time the chosen prediction and up to 2 other fitting ones in lockstep "
                           "before deciding (0 = predict only; default 3).")
    plan.add_argument("--check", dest="plan_check", action="store_true", default=False,
                      help="Pre-flight instead: judge the given schedule (the options below, or --config) against "
                           "--budget in every phase (each batch shape, the previews) and name the schedule that "
                           "would fit; exit status 0 when it fits, 1 when it does not.")
    plan.add_argument("--frames", dest="plan_frames", type=int, nargs="+", default=None, metavar="N",
                      help="Pixel-frame counts to plan for (video families; the family's frame rule applies): "
                           "the peak predicted per count (with --check: one phase per count), on synthetic "
                           "latents of the run's resolution; the schedule chosen fits every count.")
    plan.add_argument("--nproc", dest="plan_nproc", type=int, default=1, metavar="N",
                      help="Processes (GPUs) the run will use under torchrun: also predict the choice's per-rank "
                           "peak under --ddp and --fsdp and recommend DDP when a replica fits --budget, FSDP2 "
                           "otherwise, then choosing the schedule by FSDP2's per-rank peak (plan.txt's last line, nproc.json; "
                           "default 1: one process).")
    sweep.add_argument("--warmup", dest="sweep_warmup", type=int, default=1, help="Warm-up steps per mode (default 1).")
    sweep.add_argument("--measure", dest="sweep_measure", type=int, default=3,
                       help="Measured steps per mode after warm-up (default 3).")
    sweep.add_argument("--budget-gib", dest="sweep_budget", type=float, default=None,
                       help="Memory budget drawn as a line on the plot, GiB.")
    sweep.add_argument("--no-attention-offload", dest="sweep_attention", action="store_false", default=True,
                       help="Leave out the attention-offload modes (halves the sweep).")
    sweep.add_argument("--frames", dest="sweep_frames", type=int, nargs="+", default=None, metavar="N",
                       help="Pixel-frame counts to sweep (video families; each follows the family's frame rule, e.g. "
                            "Wan 4k+1): one table per count, on synthetic latents (N, C, F', h, w) of the run's "
                            "resolution, written into --output/frames-N/.")
    sweep.add_argument("--save-attention", dest="sweep_save", action="store_true", default=False,
                       help="Add every checkpointed torch and unsloth mode keeping its attention outputs "
                            "(-save-attn columns: gradient_checkpointing_save_attention).")
    sweep.add_argument("--compile", dest="sweep_compile", action="store_true", default=False,
                       help="Measure every mode again with compile_blocks (+compile columns; compile time is in "
                            "the warm-up steps, so give --warmup 2 or more).")
    sweep.add_argument("--stream", dest="sweep_stream", action="store_true", default=False,
                       help="Add the four base modes with every block's frozen weights streamed from host memory "
                            "(weight H2D GiB/step and stall %% columns).")
    run = sub.add_parser("run", help="Run an API-format workflow in-process with this pack's nodes.",
                         description="Run an API-format workflow (ComfyUI 'Save (API)') without ComfyUI. "
                                     "Folders follow ComfyUI's layout under --base-dir: input/, "
                                     "models/diffusers/, models/diffusion_models/, models/unet/, "
                                     "models/checkpoints/, models/loras/, output/.")
    run.add_argument("workflow", help="FILE.api.json")
    run.add_argument("--base-dir", default=".", help="Folder holding input/, models/ and output/ (default: .).")
    return parser


def _add_options(parser: argparse.ArgumentParser, output_help: str | None = None, schedule: bool = True,
                 options: tuple[api.Option, ...] = api.OPTIONS) -> None:
    """The flags of ``options``, generated from their metadata (``engine/config/options.py``): all
    of them for ``train``; ``sweep`` and ``plan`` (``output_help`` given) leave out those of a long
    run (steps, saving, resuming, timing warm-up), and ``sweep`` the schedule's. Given values
    override the config file; a flag's destination is the option's config key."""
    for opt in options:
        if opt.cli is None or output_help is not None and opt.meta["long_run"]:
            continue
        in_schedule = opt.path[0] == SCHEDULE_GROUP
        if in_schedule and not schedule:
            continue
        text = output_help if opt.key == "output" and output_help else _help(opt)
        if opt.type is bool:  # a flag that sets the opposite of the default
            parser.add_argument(opt.cli, dest=opt.key, action="store_const", const=not opt.default, default=None,
                                help=text)
        elif opt.type is tuple:  # --text-encoder DIR [DIR ...]
            parser.add_argument(opt.cli, dest=opt.key, nargs="+", default=None, help=text)
        else:  # the schedule's keys take 'none' and are read by CheckpointSchedule.from_config
            kind = str if in_schedule else opt.type
            parser.add_argument(opt.cli, dest=opt.key, type=kind, default=None, help=text)
    parser.add_argument("--config", dest="config_file", default=None,
                        help="JSON config (our keys, SimpleTuner's keys with or without their leading --, the six "
                             "gradient_checkpointing_* keys; README lists the SimpleTuner keys read and ignored).")


def _help(opt: api.Option) -> str:
    """An option's help with what it takes and its default."""
    text = opt.help
    if opt.choices is not None and not callable(opt.meta["choices"]):
        text += f" One of: {', '.join(map(str, opt.choices))}."
    elif opt.optional and opt.path[0] == SCHEDULE_GROUP and opt.meta["parse"] is None:
        text += " 'none' = unset."
    if opt.default is not None and opt.default is not False and opt.type is not bool:
        text += f" Default: {opt.default}."
    return text


def config_from_args(args: argparse.Namespace, precheck: bool = False) -> api.TrainConfig:
    """The :class:`~.engine.config.TrainConfig` of parsed arguments (defaults < config file <
    options); without a family, that of the ``model_path`` folder or the ``model_file`` file.

    Args:
        precheck: refuse what the options and the disk alone show is wrong (``api.precheck``:
            paths, the output folder, an empty data folder, the frame rule, ``--device cuda``
            without CUDA) before the family is read from a model (which imports diffusers).

    Raises:
        ConfigError, ScheduleError, LoraConfigError: an invalid value, named with its key.
        ModelLoadError: the model's family cannot be read from it.
        ValueError: with ``precheck``, see ``engine/data/precheck.py``.
    """
    config, from_file = api.TrainConfig(), {}
    if args.config_file:  # the keys it ignores are named in one warning
        config, from_file = api.TrainConfig.from_json_file(args.config_file, config)
    given = {k: v for k, v in vars(args).items()
             if v is not None and k not in ("command", "config_file") and not k.startswith(("sweep_", "plan_"))}
    config = api.TrainConfig.from_dict(given, config)[0]
    detect = "family" not in set(given) | set(from_file)
    if precheck:  # the family is the run's unless a model it is read from is given
        api.precheck(config, family_known=not (detect and (config.model.model_path or config.model.model_file)))
    if detect:
        # a folder that does not exist is named by the run's checks
        family = api.model_family(config.model.model_path, config.model.model_file)
        if family is not None:
            config = config.replace(family=family)
    return config


def _check_vae(config: api.TrainConfig) -> None:
    """The CLI trains on images (train, sweep, plan): a single file needs a VAE folder to encode them.

    Raises:
        ConfigError: ``model_file`` without ``vae_path``.
    """
    if config.model.model_file and not config.model.vae_path:
        raise api.ConfigError(f"vae_path=None is invalid with model_file={config.model.model_file!r}: allowed a "
                              "diffusers VAE folder (--vae-path); a single .safetensors file holds no VAE to "
                              "encode the images with")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``segckpt`` console script; returns the exit status (130 after Ctrl-C,
    which ends any command with one line, never a traceback; 2 after a file that could not be
    written, named in one line)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("segckpt: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # read only when raised: ``api.OutputWriteError`` imports the writers
        if isinstance(exc, api.OutputWriteError):  # a table, plan or preview the file system refused
            return _error(exc)
        raise


def _main(argv: Sequence[str] | None = None) -> int:
    """:func:`main` without its Ctrl-C handling."""
    args = _parser().parse_args(argv)
    _console_messages()
    if args.command == "train":
        try:
            config = config_from_args(args, precheck=True)  # the disk's refusals before any heavy import
            _check_vae(config)
            api.check_run(config)
        except ValueError as exc:  # ConfigError, ScheduleError, LoraConfigError, FolderInUseError, ...
            return _error(exc)
        cpu_threads(config)
        stop = _StopOnSignal()
        try:
            with stop:
                result = api.train(config, should_stop=stop)
        except ValueError as exc:  # PreflightRefused, ModelLoadError, DatasetError, TrainingDiverged, ...
            return _error(exc)
        finally:
            api.close_distributed()  # --fsdp or --ddp under torchrun
        if not result.writer:  # rank > 0 of a sharded run: rank 0 reports
            return 130 if result.interrupted else 0
        if result.interrupted:
            print(f"stopped by {stop.signal_name} after step {len(result.history)}: the state is saved, "
                  f"continue with the same options and --resume", file=sys.stderr)
            return 130
        graph = Path(result.report_path).parent / "loss.png"  # the Loss Graph node's two plots
        api.atomic_write_bytes(graph, api.loss_graph_png(result.history, f"{result.plan.family} - {result.plan.mode}",
                                                         result.report.get("loss_by_noise_level")))
        totals = result.report["totals"]
        sec = totals["sec_per_step"]
        print(f"loss graph: {graph}")
        print(f"done: {totals['steps']} steps, {sec:.3f} sec/step (median after warm-up), "
              f"peak {totals['peak_mib']:.1f} MiB ({totals['peak_scope']})" if sec is not None else
              f"done: {totals['steps']} steps, peak {totals['peak_mib']:.1f} MiB")
        return 0
    if args.command == "run":
        return _run_workflow(args)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "families":
        print(api.families(args.limits), end="")
        return 0
    if args.command == "options":
        print(api.options_table(), end="")
        return 0
    if args.command == "recipes":
        print(api.recipes_markdown(), end="")
        return 0
    return 2  # pragma: no cover (argparse rejects unknown commands)


def _sweep(args: argparse.Namespace) -> int:
    try:
        if args.output is None:
            args.output = "output/sweep"
        config = config_from_args(args)
        if args.sweep_warmup < 0:
            raise ValueError(f"--warmup={args.sweep_warmup} is invalid: allowed an integer >= 0")
        if args.sweep_measure < 1:
            raise ValueError(f"--measure={args.sweep_measure} is invalid: allowed an integer >= 1")
        if args.sweep_budget is not None and not 0 < args.sweep_budget < 2**20:
            raise ValueError(f"--budget-gib={args.sweep_budget} is invalid: allowed a number of GiB > 0")
        counts = api.check_measure_frames(config, args.sweep_frames) if args.sweep_frames else None
        api.check_input_paths(config)
        api.check_resolution(config)
        _check_vae(config)
        api.check_writable(config.outputs.output, "output")
        cpu_threads(config)
        bundle = api.load_model(config)
    except ValueError as exc:
        print(f"segckpt: error: {exc}", file=sys.stderr)
        return 2
    if counts is not None:
        return _sweep_frames(args, config, bundle, counts)
    budget = int(args.sweep_budget * 2**30) if args.sweep_budget else None
    folder, done = Path(config.outputs.output), []

    def write(cells: list) -> None:  # after every cell: an interrupted sweep keeps what it measured
        done[:] = [c for c in cells if c.status != "not run" or c.error]
        api.write_sweep(cells, folder, bundle.family.name, budget)

    schedules = api.sweep_schedules(args.sweep_attention, args.sweep_stream, args.sweep_save)
    stop = _StopOnSignal()
    try:
        with stop:  # the first Ctrl-C ends the sweep after the current step; a second at once
            cells = api.sweep(config, bundle, schedules, args.sweep_warmup, args.sweep_measure, on_cell=write,
                              should_stop=stop, compile_modes=args.sweep_compile)
    except (KeyboardInterrupt, api.MeasurementInterrupted):
        print(f"segckpt: interrupted: {len(done)} of {len(schedules)} modes measured; {folder}/sweep.md and the "
              "other tables hold them, the rest marked not run", file=sys.stderr)
        return 130
    paths = api.write_sweep(cells, folder, bundle.family.name, budget)
    print(Path(paths["markdown"]).read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _sweep_frames(args: argparse.Namespace, config: api.TrainConfig, bundle, counts: tuple[int, ...]) -> int:
    """``segckpt sweep --frames N ...``: one sweep per pixel-frame count, each written into
    ``--output/frames-N/`` and printed as it ends."""
    budget = int(args.sweep_budget * 2**30) if args.sweep_budget else None
    schedules = api.sweep_schedules(args.sweep_attention, args.sweep_stream, args.sweep_save)
    root, done = Path(config.outputs.output), []
    stop = _StopOnSignal()
    for n in counts:
        folder, label = root / f"frames-{n}", api.frames_label(config, bundle, n)

        def write(cells: list, folder=folder, label=label) -> None:
            done[:] = [c for c in cells if c.status != "not run" or c.error]
            api.write_sweep(cells, folder, bundle.family.name, budget, label)

        try:
            with stop:
                cells = api.sweep(config, bundle, schedules, args.sweep_warmup, args.sweep_measure, on_cell=write,
                                  should_stop=stop, frames=n, compile_modes=args.sweep_compile)
        except (KeyboardInterrupt, api.MeasurementInterrupted):
            print(f"segckpt: interrupted at {n} frames: {len(done)} of {len(schedules)} modes measured; "
                  f"{folder}/sweep.md holds them", file=sys.stderr)
            return 130
        paths = api.write_sweep(cells, folder, bundle.family.name, budget, label)
        print(Path(paths["markdown"]).read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()) + "\n")
    return 0


def _plan(args: argparse.Namespace) -> int:
    try:
        if args.output is None:
            args.output = "output/plan"
        config = config_from_args(args)
        budget = api.budget(args.plan_budget, config, key="--budget")
        host_budget = api.host_budget(args.plan_host_budget, config)  # before any model is built
        if args.plan_measure < 0:
            raise ValueError(f"--measure={args.plan_measure} is invalid: allowed an integer >= 0")
        if args.plan_nproc < 1 or (args.plan_check and args.plan_nproc > 1):
            raise ValueError(f"--nproc={args.plan_nproc} is invalid: allowed an integer >= 1"
                             + (", and 1 with --check (the pre-flight judges one process)" if args.plan_check else ""))
        counts = api.check_measure_frames(config, args.plan_frames) if args.plan_frames else None
        api.check_input_paths(config)
        api.check_resolution(config)
        _check_vae(config)
        api.check_writable(config.outputs.output, "output")
        cpu_threads(config)
        bundle = api.load_model(config)
        if args.plan_check:
            return _preflight(config, bundle, budget, host_budget, counts)
        stop = _StopOnSignal()
        with stop:  # the first Ctrl-C ends the measurement after the current step; a second at once
            choice = api.plan(config, bundle, budget, measure_steps=args.plan_measure, host_budget_bytes=host_budget,
                              levers=tuple(args.plan_levers), nproc=args.plan_nproc,
                              should_stop=stop, frames=counts)
    except ValueError as exc:  # ConfigError, PlannerError, ...
        print(f"segckpt: error: {exc}", file=sys.stderr)
        return 2
    except api.PlanInterrupted as exc:  # Ctrl-C while timing: the prediction is kept, marked not measured
        print(exc.choice.render())
        path = api.write_plan(exc.choice, Path(config.outputs.output))["text"]
        print(f"segckpt: interrupted while measuring: {path} and schedule.json hold the predicted choice "
              f"{exc.choice.chosen.schedule.mode} (not measured; run plan again to measure it)", file=sys.stderr)
        return 130
    except api.MeasurementInterrupted:  # Ctrl-C during the probe: nothing to keep yet
        print("segckpt: interrupted during the probe: nothing was measured yet, nothing written", file=sys.stderr)
        return 130
    print(choice.render())
    path = api.write_plan(choice, Path(config.outputs.output))["schedule"]
    print(f"chosen: {choice.chosen.schedule.mode}; its keys are in {path} (segckpt train --config {path})")
    return 0


def _preflight(config: api.TrainConfig, bundle, budget: int, host_budget: int | None = None,
               frames: tuple[int, ...] | None = None) -> int:
    """``segckpt plan --check``: print the verdict, write ``preflight.json`` (and the schedule that
    would fit as ``schedule.json``); 0 when the schedule fits, 1 when it does not; ``frames``: one
    phase per pixel-frame count instead of the data's shapes."""
    verdict = api.check_fit(config, bundle, budget, host_budget_bytes=host_budget, frames=frames)
    print(verdict.render())
    paths = api.write_fit(verdict, Path(config.outputs.output))
    if verdict.suggestion is not None:
        print(f"the schedule that would fit: {verdict.suggestion.mode}; its keys are in {paths['schedule']} "
              f"(segckpt train --config {paths['schedule']})")
    return 0 if verdict.fits else 1


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Where a user sets the CPU threads of torch's operations (torch reads them when it starts)."""


def cpu_threads(config: api.TrainConfig, log=print) -> int | None:
    """Choose the CPU threads of torch's operations for a CPU run whose user set none (neither of
    :data:`THREAD_VARIABLES`): every usable core but one (``api.usable_cores``), at least 1, at
    most torch's default; said in one line. Each operation's threads wait for the slowest, so one
    core taken by another process stalls them all (bench/README.md "CPU threads"). The engine
    sets no thread count (a ComfyUI server's are its own): this is the command line's choice.

    Returns:
        The threads chosen, or None (a CUDA run, or the user's own setting kept).
    """
    if any(os.environ.get(name) for name in THREAD_VARIABLES):
        return None
    with api.lazy_imports():
        import torch

    if config.model.device == "cuda" or config.model.device == "auto" and torch.cuda.is_available():
        return None
    default, cores = torch.get_num_threads(), api.usable_cores()
    threads = max(1, min(default, cores - 1))
    torch.set_num_threads(threads)
    log(f"cpu: {threads} thread{'s' if threads > 1 else ''} for torch's operations ({cores} usable cores, one left "
        f"for the rest; torch's default {default}); set OMP_NUM_THREADS to choose")
    return threads


def _console_messages() -> None:
    """Our warnings print as one ``segckpt: warning:`` line; other libraries' keep their origin
    (a torch warning is not ours to claim)."""
    def one_line(message, category, filename, lineno, *_args, **_kw) -> str:
        if category.__module__.startswith(__package__ or "segmented_checkpointing"):
            return f"segckpt: warning: {message}\n"
        return f"warning ({category.__name__}, {filename}:{lineno}): {message}\n"

    warnings.formatwarning = one_line


class _StopOnSignal:
    """Ctrl-C / SIGTERM end training cleanly after the current step (the state is saved); a
    second Ctrl-C interrupts at once."""

    def __init__(self):
        self.signal_name, self._old = None, {}

    def __call__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        rank = _torchrun_rank()
        if rank is None:
            print(f"\n{self.signal_name}: stopping after this step (again to abort)", file=sys.stderr)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        elif rank == 0:  # torchrun passes a second Ctrl-C on as SIGTERM: every process stops at the same step
            print(f"\n{self.signal_name}: every process stops after this step and the state is saved", file=sys.stderr)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _torchrun_rank() -> int | None:
    """This process's rank when ``torchrun`` started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def _error(exc: BaseException) -> int:
    """Print ``segckpt: error: ...`` (under torchrun from rank 0 only: the set-up checks are the same
    on every process) and return exit status 2."""
    if (_torchrun_rank() or 0) == 0:
        print(f"segckpt: error: {exc}", file=sys.stderr)
    return 2


def _run_workflow(args: argparse.Namespace) -> int:
    os.environ["SEGCKPT_BASE_DIR"] = args.base_dir
    with api.lazy_imports():
        from .nodes.graph import GraphError, load_api_graph, run_graph

    try:
        results = run_graph(load_api_graph(args.workflow))
    except (GraphError, ValueError) as exc:
        print(f"segckpt: error: {exc}", file=sys.stderr)
        return 2
    for node_id, value in results.items():
        if value.ui:
            for text in value.ui.get("text", []):
                print(f"[node {node_id}] {text}")
    return 0


def console_main() -> int:
    """The ``segckpt`` console script: :func:`main`, then Ctrl-C ignored while the interpreter shuts
    down (the command's work is done and its files are written; a signal landing in torch's exit
    handlers would otherwise print an "Exception ignored" traceback)."""
    status = main()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console_main())
