"""Start-up: the commands that build no model import no heavy library (docs/ARCHITECTURE.md "Start-up").

Not timed: each test asserts which modules a fresh interpreter holds after the command, the
property that makes ``segckpt --help`` instant; bench/startup.py measures the seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.families.lazy import LazyModule

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
]
"""``segckpt`` arguments, the exit status and a line of what it prints; ``{bad_value}`` and
``{bad_file}`` are config files written by the test."""

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
    (tmp_path / "value.json").write_text(json.dumps({"lora_rank": 0}))
    (tmp_path / "file.json").write_text("{not json")
    files = {"bad_value": str(tmp_path / "value.json"), "bad_file": str(tmp_path / "file.json")}
    argvs = [[a.format(**files) for a in argv] for argv, _, _ in COMMANDS]
    done = subprocess.run([sys.executable, "-c", RUN.format(heavy=HEAVY), json.dumps(argvs)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for (argv, status, line), (got, printed, loaded) in zip(COMMANDS, json.loads(done.stdout), strict=True):
        assert (got, loaded) == (status, []), (argv, printed)
        assert line in printed, (argv, printed)


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
