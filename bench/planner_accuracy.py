"""Planner accuracy: predicted against measured peak and sec/step for every candidate schedule,
and the speed of the planner's choice against the fastest fitting mode of the sweep.

Runs one planner probe and one sweep over the same candidates, in the same process, and prints
per mode the measured and predicted numbers and the relative error of the peak, then the worst
error. On CPU the peak is the live-tensor tracker's; on CUDA ``max_memory_allocated``. Then, for
budgets of 25/50/75% of the no-checkpointing peak, the planner chooses (measuring its contenders
``--plan-measure`` steps in lockstep); when the sweep's fastest fitting cell is more than
``--speed`` faster than the choice's cell, the two are timed again head to head (lockstep, 10
paired steps) and the median paired ratio is printed with ``ok`` when within ``--speed``.

    python bench/planner_accuracy.py --family flux --resolution 128
"""

from __future__ import annotations

import argparse
import warnings

import torch

from segmented_checkpointing.engine.config import MeasureConfig, TrainConfig
from segmented_checkpointing.engine.measure.lockstep import lockstep_runs, paired_ratio
from segmented_checkpointing.engine.measure.planner import PlannerError, predict
from segmented_checkpointing.engine.measure.planning import plan_for_budget
from segmented_checkpointing.engine.measure.probe import probe
from segmented_checkpointing.engine.measure.runs import Progress
from segmented_checkpointing.engine.measure.sweep import run_sweep, sweep_schedules
from segmented_checkpointing.engine.model.bundle import build_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--measure", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--plan-measure", type=int, default=6, help="lockstep steps of the planner's contenders")
    parser.add_argument("--speed", type=float, default=1.10, help="allowed sec/step ratio to the fastest fitting")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config = TrainConfig.create(family=args.family, resolution=args.resolution, device=args.device,
                         output="output/bench-planner")
    bundle = build_preset(args.family)
    measured_probe = probe(config, bundle)
    schedules = sweep_schedules()
    cells = run_sweep(config, bundle, MeasureConfig.create(measured_steps=args.measure), Progress(log=lambda line: None),
                      schedules=schedules)
    print(f"{args.family} at {args.resolution}px; probe {measured_probe.sec_per_step:.3f} sec/step, "
          f"peak {measured_probe.peak_bytes / 2**20:.3f} MiB")
    print(f"{'mode':<44} {'measured':>20} {'predicted':>20} {'peak error':>10}")
    worst = 0.0
    for schedule, cell in zip(schedules, cells):
        if cell.status != "ok":
            print(f"{cell.mode:<44} {cell.status}")
            continue
        guess = predict(measured_probe, schedule)
        error = (guess.peak_bytes - cell.peak_bytes) / cell.peak_bytes
        worst = max(worst, abs(error))
        print(f"{cell.mode:<44} {cell.sec_per_step:8.3f} / {cell.peak_bytes / 2**20:7.3f} MiB "
              f"{guess.sec_per_step:8.3f} / {guess.peak_bytes / 2**20:7.3f} MiB {error:+10.1%}")
    print(f"worst peak error: {worst:.1%}")
    speed_of_choices(config, bundle, cells, schedules, args.plan_measure, args.speed)


def speed_of_choices(config, bundle, cells, schedules, measure_steps: int, factor: float) -> None:
    """The planner's choice for 25/50/75% budgets against the sweep's fastest fitting mode."""
    by_mode = {s.mode: s for s in schedules}
    none_peak = next(c.peak_bytes for c in cells if c.mode == "none")
    for share in (0.25, 0.5, 0.75):
        budget = int(share * none_peak)
        try:
            mode = plan_for_budget(config, bundle, MeasureConfig.create(timing_steps=measure_steps),
                                   budget).chosen.schedule.mode
        except PlannerError as exc:
            print(f"budget {share:.0%}: {exc}")
            continue
        fitting = [c for c in cells if c.status == "ok" and c.peak_bytes <= budget]
        own = next(c for c in cells if c.mode == mode)
        fastest = min(fitting, key=lambda c: c.sec_per_step)
        line = f"budget {share:.0%}: chose {mode} ({own.sec_per_step:.3f} s), fastest fitting {fastest.mode} " \
               f"({fastest.sec_per_step:.3f} s)"
        if fastest.mode != mode and own.sec_per_step > factor * fastest.sec_per_step:
            mine, theirs = lockstep_runs(config, bundle, [by_mode[mode], by_mode[fastest.mode]], 1, 10)
            ratio = paired_ratio(mine, theirs, 1)
            line += f"; paired ratio {ratio:.3f} {'ok' if ratio <= factor else 'SLOWER'}"
        else:
            line += " ok"
        print(line)


if __name__ == "__main__":
    main()
