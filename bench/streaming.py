"""Host-side cost of weight streaming (engine/core/streaming.py) on the CPU, in one process.

Two figures, both on the Flux tiny preset (``--single-layers`` single blocks, default 16, so that
4, 16 and all blocks are three different rows) with a rank-8 LoRA, batch 1, per-block checkpointing:

* per-copy microseconds: the streamer's copy path for one unit (:meth:`WeightStreamer._load`:
  evict the slot's previous unit, copy the unit's frozen leaves into the slot, point the leaves
  at it, count), timed per call over ``--copies`` calls cycling through the units; median and
  minimum. On the CPU the "device" is host memory too, so this is the Python bookkeeping plus a
  ``memcpy`` of the unit's bytes (also printed).
* the streamed / resident step ratio (forward + loss + backward) at 4, 16 and all streamed blocks,
  each against the resident per-block run: all four run interleaved in one process after warm-up,
  the order rotated every round, and the figure is the median of the per-round ratios (with the
  ratio of the minima: noise from other jobs only adds time).

Run: ``python bench/streaming.py [--rounds 15] [--warmup 3] [--copies 2000] [--threads 1] [--blocks 4 16 all]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import _OpCounter, _step, build  # noqa: E402  (the same model and inputs as the runner's bench)

from segmented_checkpointing.engine.config.schedule import CheckpointSchedule  # noqa: E402
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan  # noqa: E402
from segmented_checkpointing.engine.core.runner import SegmentRunner  # noqa: E402


def runner_for(family, model, blocks: int | None, stream: bool) -> SegmentRunner:
    """Per-block checkpointing; with ``stream``, ``blocks`` blocks' frozen weights streamed (None: all)."""
    schedule = CheckpointSchedule()
    if stream:
        schedule = schedule.replace(weight_offload="stream", weight_offload_blocks=blocks)
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SegmentRunner(model, family, plan).install()


def copy_microseconds(family, model, copies: int) -> tuple[float, float, int, int]:
    """``(median us, minimum us, median unit bytes, units)`` of :meth:`WeightStreamer._load`,
    every block streamed, one call per unit in turn (each evicts the unit loaded two calls before)."""
    runner = runner_for(family, model, None, True)
    streamer = runner.streamer
    units = streamer.units
    samples = []
    for i in range(copies):
        unit = units[i % len(units)]
        if unit.slot is not None:  # the ring still holds it: load another first
            continue
        start = time.perf_counter()
        streamer._load(unit, {unit.index})
        samples.append(time.perf_counter() - start)
    sizes = statistics.median(u.nbytes for u in units)
    runner.close()
    return statistics.median(samples) * 1e6, min(samples) * 1e6, int(sizes), len(units)


def step_ratios(family, model, latents, inputs, counts: list[int | None], rounds: int, warmup: int):
    """Per streamed-block count: ``(median of per-round streamed/resident ratios, ratio of minima,
    streamed ms median, resident ms median, copies per step)``."""
    sides = {"resident": runner_for(family, copy.deepcopy(model), None, False)}
    for n in counts:
        sides[n] = runner_for(family, copy.deepcopy(model), n, True)
    names = list(sides)
    times: dict = {name: [] for name in names}
    for i in range(warmup + rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            runner = sides[name]
            runner.model.zero_grad(set_to_none=True)
            if runner.streamer is not None:
                runner.streamer.stats.reset()
            start = time.perf_counter()
            _step(family, runner.model, latents, inputs, runner.forward)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    ref = times["resident"]
    out = {}
    for n in counts:
        paired = statistics.median(a / b for a, b in zip(times[n], ref))
        out[n] = (paired, min(times[n]) / min(ref), statistics.median(times[n]) * 1e3,
                  statistics.median(ref) * 1e3, sides[n].streamer.stats.copies)
    return out


def op_counts(family, model, latents, inputs) -> tuple[int, int, int]:
    """aten operators of one step (the third), resident and every block streamed, and the streamed
    step's unit copies: a load-independent check that streaming adds copies and no other tensor work."""
    ops = []
    for stream in (False, True):
        runner = runner_for(family, copy.deepcopy(model), None, stream)
        for i in range(3):
            runner.model.zero_grad(set_to_none=True)
            if stream:
                runner.streamer.stats.reset()
            with _OpCounter() as counter:
                _step(family, runner.model, latents, inputs, runner.forward)
        ops.append(counter.ops)
    return ops[0], ops[1], runner.streamer.stats.copies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds (each runs every side once)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--copies", type=int, default=2000, help="timed unit copies")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--single-layers", type=int, default=16, help="Flux single blocks (the tiny preset has 8)")
    parser.add_argument("--blocks", nargs="+", default=["4", "16", "all"], help="streamed block counts")
    parser.add_argument("--side", type=int, default=16, help="latent side (16: 64 image tokens)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    family, model, latents, inputs = build("flux", device, args.side, {"num_single_layers": args.single_layers})
    total = count_blocks(family, model)
    total = sum(total.values()) if isinstance(total, dict) else total
    counts = [None if b == "all" else int(b) for b in args.blocks]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads "
          f"{torch.get_num_threads()}, flux tiny with {args.single_layers} single blocks ({total} blocks), "
          f"load average {os.getloadavg()[0]:.1f} at the start\n")
    started = time.perf_counter()
    us, us_min, nbytes, units = copy_microseconds(family, copy.deepcopy(model), args.copies)
    print(f"per unit copy (`WeightStreamer._load`, {units} units of median {nbytes / 1024:.0f} KiB): "
          f"median {us:.0f} us, minimum {us_min:.0f} us\n")
    print("| streamed blocks | copies/step | streamed ms/step | resident ms/step | median of paired ratios "
          "| ratio of minima |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, (paired, minima, ms, ref_ms, copies) in step_ratios(
            family, model, latents, inputs, counts, args.rounds, args.warmup).items():
        print(f"| {'all' if n is None else n} | {copies} | {ms:.1f} | {ref_ms:.1f} | {paired:.3f} | {minima:.3f} |")
    resident, streamed, copies = op_counts(family, model, latents, inputs)
    print(f"\naten operators per step (third step): resident {resident}, every block streamed {streamed} "
          f"(+{streamed - resident} for {copies} unit copies)")
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
