"""CPU threads of the default job: torch's default against the count ``segckpt`` chooses (issue 34).

``segckpt train`` (the default job: the Flux tiny preset on the sample photographs, interval 2
stride 4, 20 steps) runs in a fresh interpreter per setting and round, the settings interleaved
and their order flipped every round so that the drift of a shared machine hits them alike:

* ``OMP_NUM_THREADS=<torch's default>``: what a run got before the command line chose;
* ``OMP_NUM_THREADS=1``;
* unset: the command line's choice (``console.py`` ``cpu_threads``: every usable core but one).

Per run: the median seconds per step after the warm-up (``report.json`` ``totals.sec_per_step``)
and the whole command's wall-clock seconds. The figures to read are the ratios to torch's default,
with the load average at the start and the end (other work on the machine is the point).

Run: ``python bench/threads.py [--rounds 5] [--steps 20]``. Figures: bench/README.md "CPU threads".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _default_threads() -> int:
    """torch's own intra-op thread count in a fresh interpreter with no thread variable set."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _run(threads: str | None, steps: int, work: Path) -> tuple[float, float]:
    """(median sec/step after warm-up, wall seconds) of one default job; ``threads`` None: unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    out = Path(tempfile.mkdtemp(dir=work))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "segmented_checkpointing.cli", "train", "--output", str(out / "run"),
                           "--steps", str(steps)], env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"OMP_NUM_THREADS={threads}: exit {done.returncode}\n{done.stderr[-2000:]}")
    report = json.loads((out / "run" / "report.json").read_text())
    return report["totals"]["sec_per_step"], wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="Runs per setting (default 5).")
    parser.add_argument("--steps", type=int, default=20, help="Steps of each run (default 20, the default job's).")
    args = parser.parse_args(argv)
    default = _default_threads()
    settings = {f"OMP_NUM_THREADS={default} (torch's default)": str(default), "OMP_NUM_THREADS=1": "1",
                "unset (segckpt chooses)": None}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in list(settings) if r % 2 == 0 else list(settings)[::-1]:
                results[name].append(_run(settings[name], args.steps, Path(tmp)))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    load = (*load, *os.getloadavg())
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch's default {default} threads, Python "
          f"{platform.python_version()}, load average {load[0]:.1f} at the start and {load[3]:.1f} at the end; "
          f"{args.rounds} rounds of {args.steps} steps\n")
    base = {i: statistics.median(r[i] for r in results[next(iter(settings))]) for i in (0, 1)}
    print("| threads | sec/step (median, min-max) | job s (median, min-max) | sec/step / default | job / default |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        step, job = ([r[i] for r in runs] for i in (0, 1))
        print(f"| {name} | {statistics.median(step):.3f} ({min(step):.3f}-{max(step):.3f}) | "
              f"{statistics.median(job):.1f} ({min(job):.1f}-{max(job):.1f}) | "
              f"{statistics.median(step) / base[0]:.2f} | {statistics.median(job) / base[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
