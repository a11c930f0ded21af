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
from pathlib import Path
from typing import Sequence

# What torchao and diffusers log about torchao itself on import whenever it is installed (kernels
# built for other torch builds, torchao-serialized checkpoints) concerns nothing this command does;
# set before any engine import (peft imports torchao) so that it never reaches the console. The facade
# imports torch, diffusers and peft only when a command builds a model: --help, options, families and
# a refused option answer without them (tests/test_startup.py).
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from .console import StopOnSignal, console_messages, cpu_threads, error
from .engine import api

SCHEDULE_GROUP = "schedule"
"""The options of ``CheckpointSchedule``: ``train`` and ``plan --check`` take them, ``sweep`` runs every mode."""
_RUN_KEYS = frozenset(opt.key for opt in api.OPTIONS)
"""The destinations of the run's flags (the rest are a measurement's, or the command's own)."""


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
    sub.add_parser("options", help="Print docs/OPTIONS.md: every option and the SimpleTuner keys (generated from "
                                   "the options' metadata).")
    sub.add_parser("recipes", help="Print docs/RECIPES.md: each family's default recipe and the peers' defaults "
                                   "(imports diffusers: the families' model configs).")
    sweep = sub.add_parser("sweep", help="Measure every checkpointing mode on one model (sec/step / peak GiB).",
                           description="Run each mode (none, layer, interval 2, interval 2 stride 4; every backend "
                                       "and attention offload the family supports) for a few steps after warm-up "
                                       "and write sweep.md, sweep.csv, sweep.json and sweep.png into --output.")
    _add_options(sweep, f"Folder for sweep.md, sweep.csv, sweep.json and sweep.png (default {api.OUTPUTS['sweep']}).",
                 schedule=False)
    _add_options(sweep, options=_measure_options("sweep"))
    plan = sub.add_parser("plan", help="Pick the fastest schedule predicted to fit a memory budget.",
                          description="Probe one step without checkpointing (per-block activation bytes and "
                                      "time), predict every candidate schedule's peak and sec/step, and print "
                                      "the fastest one that fits --budget; with --measure N, time it and up to two "
                                      "other fitting candidates head to head (lockstep) and keep the fastest "
                                      "measured one that fits.")
    _add_options(plan, f"Folder for plan.txt and schedule.json (default {api.OUTPUTS['plan']}).")
    _add_options(plan, options=_measure_options("plan"), required=("budget",))
    run = sub.add_parser("run", help="Run an API-format workflow in-process with this pack's nodes.",
                         description="Run an API-format workflow (ComfyUI 'Save (API)') without ComfyUI. "
                                     "Folders follow ComfyUI's layout under --base-dir: input/, "
                                     "models/diffusers/, models/diffusion_models/, models/unet/, "
                                     "models/checkpoints/, models/loras/, output/.")
    run.add_argument("workflow", help="FILE.api.json")
    run.add_argument("--base-dir", default=".", help="Folder holding input/, models/ and output/ (default: .).")
    return parser


def _measure_options(command: str) -> tuple[api.Option, ...]:
    """The measurement options of ``command``: the shared ones and its own group's
    (``engine/config/measure.py``: ``sweep`` or ``plan``)."""
    return tuple(opt for opt in api.MEASURE_OPTIONS if len(opt.path) == 1 or opt.path[0] == command)


def _add_options(parser: argparse.ArgumentParser, output_help: str | None = None, schedule: bool = True,
                 options: tuple[api.Option, ...] = api.OPTIONS, required: tuple[str, ...] = ()) -> None:
    """The flags of ``options``, generated from their metadata (``engine/config/options.py``): all
    of them for ``train``; ``sweep`` and ``plan`` (``output_help`` given) leave out those of a long
    run (steps, saving, resuming, timing warm-up), and ``sweep`` the schedule's; then their
    measurement options (``engine/config/measure.py``), ``required``: those the command needs. Given
    values override the config file; a flag's destination is the option's config key. The run's
    options end with ``--config``, the file they are read from."""
    for opt in options:
        if opt.cli is None or output_help is not None and opt.meta["long_run"]:
            continue
        in_schedule = opt.path[0] == SCHEDULE_GROUP and options is api.OPTIONS
        if in_schedule and not schedule:
            continue
        text = output_help if opt.key == "output" and output_help else _help(opt)
        if opt.type is bool:  # a flag that sets the opposite of the default
            parser.add_argument(opt.cli, dest=opt.key, action="store_const", const=not opt.default, default=None,
                                help=text)
        elif opt.type is tuple:  # --text-encoder DIR [DIR ...]
            parser.add_argument(opt.cli, dest=opt.key, nargs="+", default=None, help=text)
        else:  # the schedule's keys take 'none' and are read by CheckpointSchedule.from_config
            kind = str if in_schedule or opt.meta["parse"] is not None else opt.type
            parser.add_argument(opt.cli, dest=opt.key, type=kind, default=None, help=text,
                                required=opt.key in required)
    if options is api.OPTIONS:
        parser.add_argument("--config", dest="config_file", default=None,
                            help="JSON config (our keys, SimpleTuner's keys with or without their leading --, the six "
                                 "gradient_checkpointing_* keys; docs/OPTIONS.md lists the SimpleTuner keys read and ignored).")


def _help(opt: api.Option) -> str:
    """An option's help with what it takes and its default."""
    text = opt.help
    if opt.choices is not None and not callable(opt.meta["choices"]):
        text += f" One of: {', '.join(map(str, opt.choices))}."
    elif opt.optional and opt.path[0] == SCHEDULE_GROUP and opt.meta["parse"] is None:
        text += " 'none' = unset."
    if opt.default is not None and opt.default is not False and opt.default != () and opt.type is not bool:
        text += f" Default: {opt.default}."
    return text.replace("%", "%%")  # argparse formats help with %


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
    given = {k: v for k, v in vars(args).items() if v is not None and k in _RUN_KEYS}
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
            return error(exc)
        raise


def _main(argv: Sequence[str] | None = None) -> int:
    """:func:`main` without its Ctrl-C handling."""
    args = _parser().parse_args(argv)
    console_messages()
    commands = {"train": _train, "run": _run_workflow, "sweep": _sweep, "plan": _plan,  # a table's on first use:
                "families": lambda: api.families(args.limits), "options": lambda: api.options_page(),
                "recipes": lambda: api.recipes_markdown()}  # api.recipes_markdown imports diffusers
    if args.command in ("train", "run", "sweep", "plan"):
        return commands[args.command](args)
    print(commands[args.command](), end="")  # a table
    return 0


def _train(args: argparse.Namespace) -> int:
    """``segckpt train``: the run, its loss graph and one line of totals."""
    try:
        config = config_from_args(args, precheck=True)  # the disk's refusals before any heavy import
        api.check_vae(config.model)
        api.check_run(config)
    except ValueError as exc:  # ConfigError, ScheduleError, LoraConfigError, FolderInUseError, ...
        return error(exc)
    cpu_threads(config)
    stop = StopOnSignal()
    try:
        with stop:
            result = api.train(config, should_stop=stop)
    except ValueError as exc:  # PreflightRefused, ModelLoadError, DatasetError, TrainingDiverged, ...
        return error(exc)
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


def _measurement(args: argparse.Namespace) -> tuple[api.TrainConfig, api.MeasureConfig]:
    """The run a measurement measures (its output folder by default the command's) and how
    (``engine/config/measure.py``), both validated before any model is built.

    Raises:
        ConfigError, ScheduleError, LoraConfigError, ModelLoadError: see :func:`config_from_args`.
    """
    if args.output is None:
        args.output = api.OUTPUTS[args.command]
    measure = api.MeasureConfig.create(**{opt.key: getattr(args, opt.key) for opt in _measure_options(args.command)
                                          if getattr(args, opt.key) is not None})
    config = config_from_args(args)
    cpu_threads(config)
    return config, measure


def _sweep(args: argparse.Namespace) -> int:
    """``segckpt sweep``: the tables printed and written (``--frames``: one per count)."""
    stop = StopOnSignal()
    try:
        config, measure = _measurement(args)
        with stop:  # the first Ctrl-C ends the sweep after the current step; a second at once
            tables = api.sweep(config, measure, api.Progress(should_stop=stop))
    except ValueError as exc:  # ConfigError, ScheduleError, ModelLoadError, ...
        return error(exc)
    except api.SweepInterrupted as exc:  # the tables hold what was measured
        print(f"segckpt: {exc}", file=sys.stderr)
        return 130
    for table in tables:
        print(Path(table.paths["markdown"]).read_text(), end="\n" if len(tables) > 1 else "")
        print("wrote " + ", ".join(str(p) for p in table.paths.values()) + ("\n" if len(tables) > 1 else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """``segckpt plan``: the choice printed, plan.txt and schedule.json written (``--check``: the pre-flight)."""
    stop = StopOnSignal()
    try:
        config, measure = _measurement(args)
        if measure.plan.preflight:
            return _preflight(config, measure)
        with stop:  # the first Ctrl-C ends the measurement after the current step; a second at once
            choice = api.plan(config, measure, api.Progress(should_stop=stop))
    except ValueError as exc:  # ConfigError, PlannerError, ...
        return error(exc)
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


def _preflight(config: api.TrainConfig, measure: api.MeasureConfig) -> int:
    """``segckpt plan --check``: print the verdict, write ``preflight.json`` (and the schedule that
    would fit as ``schedule.json``); 0 when the schedule fits, 1 when it does not."""
    verdict = api.check_fit(config, measure)
    print(verdict.render())
    paths = api.write_fit(verdict, Path(config.outputs.output))
    if verdict.suggestion is not None:
        print(f"the schedule that would fit: {verdict.suggestion.mode}; its keys are in {paths['schedule']} "
              f"(segckpt train --config {paths['schedule']})")
    return 0 if verdict.fits else 1


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
