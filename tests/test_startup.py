"""Start-up: the commands that build no model import no heavy library (docs/ARCHITECTURE.md "Start-up"),
and neither do the refusals that look at the disk (issue 34: each imported torch and diffusers first).

Not timed: each test asserts which modules a fresh interpreter holds after the command, the
property that makes ``segckpt --help`` instant; bench/startup.py measures the seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.families.lazy import LazyModule
from segmented_checkpointing.engine.files.lock import FolderLock

HEAVY = ("torch", "diffusers", "peft", "torchao", "transformers", "accelerate", "safetensors")
"""What a command that builds no model must not import (the family model classes are diffusers')."""

COMMANDS = [
    (["--help"], 0, "usage: segckpt"),
    (["train", "--help"], 0, "--interval"),
    (["options"], 0, "| `gradient_checkpointing_interval` |"),
    (["families"], 0, "| flux |"),
    (["train", "--steps", "-1"], 2, "steps=-1 is invalid"),
    (["train", "--interval", "0"], 2, "gradient_checkpointing_interval=0 is invalid"),
    (["train", "--family", "dalle"], 2, "family='dalle' is invalid"),
    (["train", "--config", "{bad_value}"], 2, "lora_rank=0 is invalid"),
    (["train", "--config", "{bad_file}"], 2, "could not be read as JSON"),
    (["train", "--config", "{typo}"], 2, "lora_rnak=8 is invalid: not a key of this pack; did you mean lora_rank?"),
    (["train", "--config", "{twice}"], 2, "key 'lora_rank' appears twice in one object (8, then 16)"),
    (["plan", "--budget", "1", "--steps", "2"], 2, "unrecognized arguments: --steps 2 (segckpt plan --help lists"),
    (["plan", "--budget", "1", "--nproc", "0"], 2, "nproc=0 is invalid: allowed an integer from 1 to 1024"),
]
"""``segckpt`` arguments, the exit status and a line of what it prints; ``{bad_value}`` and the
other names in braces are config files and folders written by the test."""

DISK_REFUSALS = [
    (["train", "--data", "{missing}"], 2, "data='{missing}' is invalid: allowed an existing folder"),
    (["train", "--model-file", "{missing}.safetensors"], 2, "model_file='{missing}.safetensors' is invalid"),
    (["train", "--data", "{empty}"], 2, "data='{empty}' holds no image"),
    (["train", "--output", "{blocker}/out"], 2, "output='{blocker}/out' is invalid: allowed a folder this process "
                                                 "can write ('{blocker}' is a file, not a folder"),
    (["train", "--data", "{empty}", "--output", "{empty}/out"], 2, "output='{empty}/out' is invalid with "
                                                                   "data='{empty}': allowed a folder outside"),
    (["train", "--family", "wan", "--num-frames", "10"], 2, "num_frames=10 is invalid for wan: allowed 4k+1 (9, 13"),
    (["train", "--output", "{finished}"], 2, "output='{finished}' is invalid: allowed a folder without a training "
                                             "run: it holds one; pass --resume"),
    (["train", "--resume", "--output", "{empty}"], 2, "resume=True is invalid: allowed only when {empty}/training_state"),
    (["train", "--resume", "--output", "{held}"], 2, "output='{held}' is in use by process {pid} (running segckpt "
                                                     "train since "),
]
"""Refusals that look at the disk (issue 34, item 6): answered before torch, diffusers or any other
heavy library is imported; ``{held}`` is a folder whose lock the test process holds."""

RUN = """
import contextlib, io, json, sys
from segmented_checkpointing import cli
heavy, answers = {heavy!r}, []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's --help
            status = exc.code
    answers.append([status, out.getvalue(), [m for m in heavy if m in sys.modules]])
print(json.dumps(answers))
"""


def test_help_options_families_and_refused_options_import_no_heavy_library(tmp_path):
    """Also every refusal that looks at the disk (:data:`DISK_REFUSALS`, ``--device cuda`` where this
    machine has no GPU device): one fresh interpreter answers them all, and holds no heavy module after."""
    (tmp_path / "value.json").write_text(json.dumps({"lora_rank": 0}))
    (tmp_path / "file.json").write_text("{not json")
    (tmp_path / "typo.json").write_text(json.dumps({"lora_rnak": 8, "steps": 3}))
    (tmp_path / "twice.json").write_text('{"lora_rank": 8, "steps": 3, "lora_rank": 16}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "blocker").write_text("a file where a folder should be")
    (tmp_path / "finished").mkdir()
    (tmp_path / "finished" / "training_state.safetensors").write_bytes(b"a run's state")  # only its presence counts
    files = {"bad_value": str(tmp_path / "value.json"), "bad_file": str(tmp_path / "file.json"),
             "typo": str(tmp_path / "typo.json"), "twice": str(tmp_path / "twice.json"),
             "missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"),
             "blocker": str(tmp_path / "blocker"), "held": str(tmp_path / "held"), "pid": os.getpid(),
             "finished": str(tmp_path / "finished")}
    cuda = [(["train", "--device", "cuda"], 2, "device='cuda' is invalid")] if api.cuda_absent() else []
    commands = [([a.format(**files) for a in argv], status, line.format(**files))
                for argv, status, line in COMMANDS + DISK_REFUSALS + cuda]
    holder = FolderLock(tmp_path / "held", "segckpt train")  # a live run of another process holds it
    try:
        done = subprocess.run([sys.executable, "-c", RUN.format(heavy=HEAVY), json.dumps([c[0] for c in commands])],
                              capture_output=True, text=True, cwd=tmp_path)
    finally:
        holder.release()
    assert done.returncode == 0, done.stderr
    for (argv, status, line), (got, printed, loaded) in zip(commands, json.loads(done.stdout), strict=True):
        assert (got, loaded) == (status, []), (argv, printed)
        assert line in printed, (argv, printed)
    held = json.loads(done.stdout)[-1 - len(cuda)][1]
    mine = " ".join(Path(f"/proc/{os.getpid()}/cmdline").read_bytes().decode().replace("\0", " ").split())
    assert f"; command line: {mine[:200]}" in held  # the holder's command line, as /proc shows it


def test_the_facade_serves_every_name_it_exports_from_its_module():
    from segmented_checkpointing.engine.model.bundle import ModelBundle
    from segmented_checkpointing.engine.train.loop import TrainResult

    assert [n for n in api.__all__ if not hasattr(api, n)] == []
    assert (api.ModelBundle, api.TrainResult) == (ModelBundle, TrainResult)
    assert {"ModelBundle", "train", "TrainConfig"} <= set(dir(api))
    with pytest.raises(AttributeError, match="module 'segmented_checkpointing.engine.api' has no attribute 'nope'"):
        api.nope  # noqa: B018


def test_the_lazy_module_imports_on_the_first_read_and_then_is_the_module():
    import torch

    from segmented_checkpointing.engine.families.lazy import torch as lazy_torch

    assert (lazy_torch.zeros, lazy_torch.nn.ModuleList) == (torch.zeros, torch.nn.ModuleList)
    missing = LazyModule("segckpt_no_such_module")  # nothing is imported yet: no error
    assert missing.__name__ == "segckpt_no_such_module"
    with pytest.raises(ModuleNotFoundError, match="segckpt_no_such_module"):
        missing.anything  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_function"):
        lazy_torch.no_such_function  # noqa: B018
