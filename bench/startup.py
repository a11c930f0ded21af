"""Start-up time of the commands that build no model, and of the pack's import inside ComfyUI.

Each figure is the median wall-clock time of a fresh interpreter (``time.perf_counter`` around
``subprocess.run``) over ``--rounds`` rounds; the sides run interleaved, the order flipped every
round, so drift of a shared machine hits both alike. Measured, for this checkout ("after") and,
with ``--before CHECKOUT``, another one ("before", e.g. the main branch):

* ``import torch`` alone (the reference: the least any command that imports torch costs);
* ``segckpt --help``, ``segckpt families`` and a refused config (``train --config`` of a file with
  ``lora_rank: 0``, refused with exit status 2 before any model is built);
* the refusals of ``segckpt train`` that look at the disk (issue 34): a missing data folder, an
  empty one, an output folder that cannot be written (a file stands where it should be), an output
  folder inside the data, a family's frame rule (``--family wan --num-frames 10``), a ``--resume``
  into a folder whose lock this process holds (as a live run would), and ``--device cuda`` where
  torch sees no CUDA.

Each side's package is imported from its checkout (a temporary folder holding a
``segmented_checkpointing`` link to it is put first on ``PYTHONPATH``), whatever is installed.
With ``--comfyui DIR``, ComfyUI's ``main.py --quick-test-for-ci`` starts once per side and round with
``--base-directory`` in a temporary folder whose ``custom_nodes/`` links to the side's checkout
(nothing is written into the ComfyUI checkout), and the pack's line of ComfyUI's "Import times
for custom nodes" is read (0.1 s resolution), with the server's whole start-up time.

Run: ``python bench/startup.py [--rounds 5] [--before /path/to/main] [--comfyui DIR
[--comfyui-python PY] [--comfyui-rounds 2]]``. Figures: bench/README.md "Start-up".
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK_FOLDER = "comfyui-segmented-checkpointing"
COMMANDS = {
    "import torch": (["-c", "import torch"], 0),
    "segckpt --help": (["-m", "segmented_checkpointing.cli", "--help"], 0),
    "segckpt families": (["-m", "segmented_checkpointing.cli", "families"], 0),
    "refused config": (["-m", "segmented_checkpointing.cli", "train", "--config", "{config}"], 2),
    "refused: missing data folder": (["-m", "segmented_checkpointing.cli", "train", "--data", "{missing}"], 2),
    "refused: empty data folder": (["-m", "segmented_checkpointing.cli", "train", "--data", "{empty}"], 2),
    "refused: output not writable": (["-m", "segmented_checkpointing.cli", "train", "--output", "{blocker}/out"], 2),
    "refused: output inside data": (["-m", "segmented_checkpointing.cli", "train", "--data", "{empty}", "--output",
                                     "{empty}/out"], 2),
    "refused: frame rule": (["-m", "segmented_checkpointing.cli", "train", "--family", "wan", "--num-frames", "10"], 2),
    "refused: resume into a held folder": (["-m", "segmented_checkpointing.cli", "train", "--resume", "--output",
                                            "{held}"], 2),
    "refused: --device cuda": (["-m", "segmented_checkpointing.cli", "train", "--device", "cuda"], 2),
}
"""Name: interpreter arguments and the exit status they must end with."""
IMPORT_LINE = re.compile(r"^\s*([\d.]+) seconds(?: \(IMPORT FAILED\))?: (.+)$")


def _link(checkout: Path, folder: Path) -> str:
    """A ``PYTHONPATH`` under which ``segmented_checkpointing`` is ``checkout``."""
    folder.mkdir(parents=True)
    (folder / "segmented_checkpointing").symlink_to(checkout.resolve(), target_is_directory=True)
    return str(folder)


def _run(args: list[str], env: dict, status: int, cwd: Path) -> float:
    """Seconds one interpreter took; raises when it ends with another exit status."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != status:
        raise RuntimeError(f"{args} ended with {done.returncode}, not {status}:\n{done.stderr[-2000:]}")
    return seconds


def _hold(folder: Path) -> int:
    """Hold ``folder``'s run lock (``engine/files/lock.py``'s file) as a live run does; the open file."""
    folder.mkdir()
    fd = os.open(folder / ".segckpt.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": "bench/startup.py",
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    return fd


def _commands() -> dict[str, tuple[list[str], int]]:
    """:data:`COMMANDS`, without ``--device cuda`` where torch sees a CUDA device (it would train)."""
    cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, check=True).stdout.strip() == "True"
    return {k: v for k, v in COMMANDS.items() if not (cuda and k == "refused: --device cuda")}


def measure_commands(sides: dict[str, Path], rounds: int, work: Path) -> dict[str, dict[str, list[float]]]:
    """Seconds per command and side, ``rounds`` interleaved runs each."""
    config = work / "refused.json"
    config.write_text(json.dumps({"lora_rank": 0}))
    (work / "empty").mkdir()
    (work / "blocker").write_text("a file where a folder should be")
    names = {"config": config, "missing": work / "missing", "empty": work / "empty", "blocker": work / "blocker",
             "held": work / "held"}
    held, commands = _hold(work / "held"), _commands()
    envs = {}
    for name, checkout in sides.items():
        path = _link(checkout, work / f"path-{name}")
        envs[name] = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        shown = subprocess.run([sys.executable, "-c", "import segmented_checkpointing as s; print(s.__file__)"],
                               env=envs[name], capture_output=True, text=True, check=True).stdout.strip()
        print(f"{name}: {shown} ({_commit(checkout)})", file=sys.stderr)
    times = {command: {name: [] for name in sides} for command in commands}
    order = list(sides)
    for r in range(rounds):
        for command, (args, status) in commands.items():
            for name in order if r % 2 == 0 else order[::-1]:
                args_ = [a.format(**names) for a in args]
                times[command][name].append(_run(args_, envs[name], status, work))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    os.close(held)
    return times


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip()[:60] or "no git") + (" + uncommitted changes" if dirty else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comfyui_import(comfyui: Path, python: str, checkout: Path, work: Path) -> tuple[float, float]:
    """(the pack's import seconds as ComfyUI prints them, the server's start-up seconds to its exit)
    of one ``main.py --quick-test-for-ci`` run with ``checkout`` as its only custom node."""
    base = Path(tempfile.mkdtemp(dir=work))
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(checkout.resolve(), target_is_directory=True)
    command = [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(_free_port()),
               "--base-directory", str(base), "--quick-test-for-ci"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=comfyui, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""})
    seconds = time.perf_counter() - start
    for line in (done.stdout + done.stderr).splitlines():
        match = IMPORT_LINE.match(line)
        if match and match.group(2).rstrip("/").endswith(PACK_FOLDER):
            if "IMPORT FAILED" in line:
                raise RuntimeError(f"ComfyUI could not import {checkout}:\n{done.stderr[-3000:]}")
            return float(match.group(1)), seconds
    raise RuntimeError(f"no import time for {PACK_FOLDER} (exit {done.returncode}):\n{done.stderr[-3000:]}")


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(times: dict[str, dict[str, list[float]]], comfy: dict[str, list[tuple[float, float]]]) -> str:
    """The markdown tables of :func:`measure_commands` and :func:`comfyui_import` figures."""
    sides = list(next(iter(times.values())))
    torch_s = {name: _median(times["import torch"][name]) for name in sides}
    head = " | ".join(f"{n} s (median, min-max)" for n in sides)
    lines = [f"| command | {head} | " + " | ".join(f"{n} / import torch" for n in sides)
             + (" | after / before |" if len(sides) == 2 else " |"),
             "|---" * (1 + 2 * len(sides) + (len(sides) == 2)) + "|"]
    for command, by_side in times.items():
        cells = [f"{_median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in by_side.values()]
        ratios = [f"{_median(by_side[n]) / torch_s[n]:.2f}" for n in sides]
        row = f"| {command} | " + " | ".join(cells + ratios)
        if len(sides) == 2:
            row += f" | {_median(by_side[sides[1]]) / _median(by_side[sides[0]]):.2f}"
        lines.append(row + " |")
    if comfy:
        lines += ["", "| ComfyUI | " + " | ".join(comfy) + " |", "|---" * (1 + len(comfy)) + "|"]
        for i, label in enumerate(("pack import s (ComfyUI's figure)", "server start to exit s")):
            lines.append(f"| {label} | " + " | ".join(
                f"{_median([r[i] for r in runs]):.1f} ({', '.join(f'{r[i]:.1f}' for r in runs)})"
                for runs in comfy.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="Runs of each command per side (default 5).")
    parser.add_argument("--before", type=Path, default=None, help="Another checkout to compare with (e.g. main).")
    parser.add_argument("--comfyui", type=Path, default=None, help="A ComfyUI checkout: also time the pack's import.")
    parser.add_argument("--comfyui-python", default=sys.executable, help="ComfyUI's interpreter (default: this one).")
    parser.add_argument("--comfyui-rounds", type=int, default=2, help="ComfyUI starts per side (default 2).")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.comfyui_rounds < 1:
        parser.error("--rounds and --comfyui-rounds take an integer >= 1")
    sides = {"before": args.before, "after": ROOT} if args.before else {"after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        load = os.getloadavg()
        times = measure_commands(sides, args.rounds, work)
        comfy: dict[str, list[tuple[float, float]]] = {name: [] for name in sides} if args.comfyui else {}
        for r in range(args.comfyui_rounds if args.comfyui else 0):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                comfy[name].append(comfyui_import(args.comfyui, args.comfyui_python, sides[name], work))
        load = (*load, *os.getloadavg())
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
          f"{load[0]:.1f} at the start and {load[3]:.1f} at the end; {args.rounds} rounds")
    print(report(times, comfy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
