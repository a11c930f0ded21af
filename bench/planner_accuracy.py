"""Planner accuracy: predicted against measured peak and sec/step for every candidate schedule.

Runs one planner probe and one sweep over the same candidates, in the same process, and prints
per mode the measured and predicted numbers and the relative error of the peak, then the worst
error. On CPU the peak is the live-tensor tracker's; on CUDA ``max_memory_allocated``.

    python bench/planner_accuracy.py --family flux --resolution 128
"""

from __future__ import annotations

import argparse
import warnings

import torch

from segmented_checkpointing.engine.measure.planner import predict
from segmented_checkpointing.engine.measure.probe import probe
from segmented_checkpointing.engine.measure.sweep import run_sweep, sweep_schedules
from segmented_checkpointing.engine.train.config import TrainConfig
from segmented_checkpointing.engine.train.loading import build_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--measure", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    config = TrainConfig(family=args.family, resolution=args.resolution, device=args.device,
                         output="output/bench-planner")
    bundle = build_preset(args.family)
    measured_probe = probe(config, bundle)
    schedules = sweep_schedules()
    cells = run_sweep(config, bundle, schedules, 1, args.measure, log=lambda line: None)
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


if __name__ == "__main__":
    main()
