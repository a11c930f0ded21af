"""Planner accuracy: predicted against measured peak and sec/step for every mode ``segckpt sweep
--stream`` measures, and the planner's choice at 25/50/75% budgets against the fastest fitting mode.

One planner probe, then every mode trained in lockstep with the plain step
(:mod:`engine.measure.lockstep`: one step of each in turn, two models at a time, so a shared
machine's drift hits both alike and the caches stay as warm as in a sweep's one-mode runs) for
``--measure`` steps after ``--warmup``; a mode's measured sec/step is the median of its steps, its
peak the largest after warm-up. Per mode it prints measured and predicted ``sec/step / peak MiB``, the relative
error of sec/step, of sec/step as a ratio to the plain step's (``x none``: what ranks the modes,
and what a change of the machine's load between probe and sweep leaves alone) and of the peak,
then their median and worst absolute values. For budgets of 25/50/75% of the plain step's
measured peak, the planner chooses from the probe alone (:func:`choose`, the same candidates,
streaming allowed) and the choice, which must measure within the budget, is compared with the
fastest mode measured within the budget less the planner's headroom (``MARGIN``), the two timed
again head to head: ``ok`` when it is that mode or its paired ratio is within ``--tie``.

    python bench/planner_accuracy.py --family flux --resolution 128
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.measure.lockstep import lockstep_runs, paired_ratio, step_seconds
from segmented_checkpointing.engine.measure.planner import MARGIN, PlannerError, choose, predict
from segmented_checkpointing.engine.measure.probe import probe
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.measure.sweep import sweep_schedules
from segmented_checkpointing.engine.model.bundle import build_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measure", type=int, default=7, help="lockstep steps of every mode after warm-up")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tie", type=float, default=0.05, help="measured sec/step within which two modes tie")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    # weight_offload=stream: the probe calibrates streaming too (the sweep's stream modes are candidates)
    config = TrainConfig.create(family=args.family, resolution=args.resolution, device=args.device,
                                output="output/bench-planner", weight_offload="stream")
    bundle = build_preset(args.family)
    schedules = sweep_schedules(streaming=True)
    with RunWorkspace(config, bundle) as workspace:
        measured_probe = probe(workspace)
        # each mode in lockstep with the plain step: two models at a time, as warm in cache as a sweep's
        # one-mode-at-a-time runs, and the machine's drift cancels in their ratio
        pairs = [lockstep_runs(workspace, [schedules[0], schedule], args.warmup, args.measure)
                 for schedule in schedules]
    print(f"{args.family} at {args.resolution}px; probe {measured_probe.sec_per_step:.4f} sec/step, "
          f"peak {measured_probe.peak_bytes / 2**20:.3f} MiB; {len(schedules)} modes x {args.measure} lockstep steps")
    print(f"{'mode':<44} {'measured s / MiB':>18} {'predicted s / MiB':>18} {'time error':>10} {'x none':>8} "
          f"{'peak error':>10}")
    measured, time_errors, ratio_errors, peak_errors = {}, [], [], []
    none_predicted = predict(measured_probe, schedules[0]).sec_per_step  # schedules[0] is none
    for schedule, (plain, result) in zip(schedules, pairs):
        seconds = statistics.median(step_seconds(result, args.warmup))
        peak = peak_after_warmup(result, args.warmup)
        measured[schedule.mode] = (schedule, result, seconds, peak)
        guess = predict(measured_probe, schedule)
        time_error = (guess.sec_per_step - seconds) / seconds
        # the same as a ratio to the plain step (the machine's load between probe and sweep cancels)
        ratio_error = (guess.sec_per_step / none_predicted) / paired_ratio(result, plain, args.warmup) - 1
        peak_error = (guess.peak_bytes - peak) / peak
        time_errors.append(abs(time_error))
        ratio_errors.append(abs(ratio_error))
        peak_errors.append(abs(peak_error))
        print(f"{schedule.mode:<44} {seconds:8.4f} / {peak / 2**20:7.3f} {guess.sec_per_step:8.4f} / "
              f"{guess.peak_bytes / 2**20:7.3f} {time_error:+10.1%} {ratio_error:+8.1%} {peak_error:+10.1%}")
    plains = [statistics.median(step_seconds(plain, args.warmup)) for plain, _ in pairs]
    print(f"the plain step measured {min(plains):.4f}-{max(plains):.4f} s across the pairs (the machine's drift)")
    print(f"sec/step error: median {statistics.median(time_errors):.1%}, worst {max(time_errors):.1%}; as a ratio "
          f"to none: median {statistics.median(ratio_errors):.1%}, worst {max(ratio_errors):.1%}; peak error: median "
          f"{statistics.median(peak_errors):.1%}, worst {max(peak_errors):.1%}")
    choices(config, bundle, measured_probe, schedules, measured, args)


def choices(config, bundle, measured_probe, schedules, measured: dict, args) -> None:
    """The planner's choice at 25/50/75% of the plain step's measured peak against the fastest
    measured mode whose measured peak fits; a choice the sweep does not measure (a streamed
    fraction) is measured in lockstep with that mode."""
    none_peak = measured["none"][3]
    for share in (0.25, 0.5, 0.75):
        budget = int(share * none_peak)
        try:
            chosen = choose(measured_probe, budget, schedules, stream=True).chosen.schedule
        except PlannerError as exc:
            print(f"budget {share:.0%}: {exc}")
            continue
        fitting = [m for m in measured.values() if m[3] <= budget * (1 - MARGIN)]  # the planner's headroom
        if not fitting:
            print(f"budget {share:.0%}: chose {chosen.mode}; no mode measured within the budget")
            continue
        fastest = min(fitting, key=lambda m: m[2])
        with RunWorkspace(config, bundle) as workspace:  # the two head to head, in lockstep
            own, theirs = lockstep_runs(workspace, [chosen, fastest[0]], args.warmup, args.measure)
        seconds, peak = statistics.median(step_seconds(own, args.warmup)), peak_after_warmup(own, args.warmup)
        ratio = paired_ratio(own, theirs, args.warmup)
        ok = peak <= budget and (chosen.mode == fastest[0].mode or ratio <= 1 + args.tie)
        print(f"budget {share:.0%} ({budget / 2**20:.2f} MiB): chose {chosen.mode} ({seconds:.4f} s, "
              f"{peak / 2**20:.2f} MiB); fastest fitting {fastest[0].mode} ({fastest[2]:.4f} s), paired ratio "
              f"{ratio:.3f}: {'ok' if ok else 'NOT the fastest fitting'}")


if __name__ == "__main__":
    main()
