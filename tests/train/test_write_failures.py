"""Writes that fail end in one line, exit 2, with the last saved state intact and resumable; one
run per output folder.

The runs are ``segckpt`` processes forked from one warm server (``tests/cli_server.py``): a
read-only output folder (``chattr +i``, or mode 0555 where the tests do not run as root), a disk
that fills during the save (``RLIMIT_FSIZE`` between the LoRA's size and the state's), and two
runs started together into one folder.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cli_server import CliServer
from safetensors import safe_open

from segmented_checkpointing.engine.files.atomic import OutputWriteError, atomic_write_text, check_writable
from segmented_checkpointing.engine.files.lock import LOCK_FILE, FolderInUseError, FolderLock
from segmented_checkpointing.engine.train.state import STATE_FILE, load_state


@pytest.fixture(scope="module")
def server():
    s = CliServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def two_steps(server, tmp_path_factory):
    """A finished 2-step run (state saved), copied by each test that resumes it."""
    root = tmp_path_factory.mktemp("two-steps")
    status, log = server.run(_argv(root / "run", 2), root / "first.log")
    assert status == 0, log[-3000:]
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _argv(out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--steps", str(steps), "--resolution", "32", "--output", str(out), *extra]


def _one_error_line(status: int, log: str) -> str:
    """The refusal: exit 2, no traceback, the last line ``segckpt: error: ...``; that line."""
    assert status == 2, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("segckpt: error: "), log[-3000:]
    return last


def _read_only(folder: Path):
    """Make ``folder`` unwritable the way this machine allows; the undo."""
    if os.geteuid() != 0:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
        return lambda: folder.chmod(0o755)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("running as root without chattr +i here: no way to make a folder read-only")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def _steps_in_lora(path: Path) -> int:
    with safe_open(str(path), "pt") as fh:
        return int(fh.metadata()["steps"])


def test_a_read_only_output_folder_is_refused_before_any_model_and_the_state_resumes(server, two_steps, tmp_path):
    out = _copy(two_steps, tmp_path)
    before = (out / STATE_FILE).read_bytes()
    undo = _read_only(out)
    try:
        status, log = server.run(_argv(out, 4, "--resume"), tmp_path / "refused.log")
    finally:
        undo()
    line = _one_error_line(status, log)
    assert f"output={str(out)!r} is invalid: allowed a folder this process can write" in line
    assert "plan " not in log and "blocks" not in log  # refused before the model was built (no plan printed)
    assert (out / STATE_FILE).read_bytes() == before
    status, log = server.run(_argv(out, 4, "--resume"), tmp_path / "resumed.log")
    assert status == 0, log[-3000:]
    assert "resumed at step 2" in log and load_state(out).step == 4


def test_a_disk_that_fills_during_the_save_keeps_the_lora_and_the_last_state(server, two_steps, tmp_path):
    out = _copy(two_steps, tmp_path)
    lora = max((out / name).stat().st_size for name in ("lora.safetensors", "lora_comfyui.safetensors"))
    state = (out / STATE_FILE).stat().st_size
    assert lora < state  # room for a limit between them
    before = (out / STATE_FILE).read_bytes()
    limit = (lora + state) // 2  # both LoRA files fit, the state does not: "File too large"
    status, log = server.run(_argv(out, 4, "--resume"), tmp_path / "full.log", fsize=limit)
    line = _one_error_line(status, log)
    assert f"cannot write {str(out / STATE_FILE)!r}: " in line and "too large" in line.lower()
    assert f"the last saved state (step 2, {out / STATE_FILE}) is intact and resumes with --resume" in line
    assert f"the LoRA of step 4 is saved in {out / 'lora.safetensors'}, {out / 'lora_comfyui.safetensors'}" in line
    assert (out / STATE_FILE).read_bytes() == before
    assert _steps_in_lora(out / "lora.safetensors") == 4  # written first, whole
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left
    status, log = server.run(_argv(out, 4, "--resume"), tmp_path / "resumed.log")
    assert status == 0, log[-3000:]
    assert "resumed at step 2" in log and load_state(out).step == 4


def test_two_runs_started_together_into_one_folder_one_trains_one_names_the_holder(server, tmp_path):
    out = tmp_path / "shared"
    pids = [server.start(_argv(out, 2), tmp_path / f"run{i}.log") for i in range(2)]
    statuses = [server.wait(pid) for pid in pids]
    logs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
    assert sorted(statuses) == [0, 2], logs
    winner, loser = (0, 1) if statuses[0] == 0 else (1, 0)
    line = _one_error_line(statuses[loser], logs[loser])
    assert f"output={str(out)!r} is in use by process {pids[winner]} (running training since " in line
    assert load_state(out).step == 2
    status, log = server.run(_argv(out, 2), tmp_path / "after.log")  # released: now it is a finished run
    assert "holds one; pass --resume to continue it or --overwrite" in _one_error_line(status, log)


def test_the_lock_is_per_open_file_released_on_exit_and_names_a_dead_holder(tmp_path):
    first = FolderLock(tmp_path, "training")
    with pytest.raises(FolderInUseError, match=r"is in use by another run in this process \(running training"):
        FolderLock(tmp_path)  # a second graph queued into the same folder of one ComfyUI server
    first.release()
    assert not first.held and (tmp_path / LOCK_FILE).read_text() == ""
    FolderLock(tmp_path).release()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(f'{{"pid": {dead.pid}, "host": "{os.uname().nodename}"}}')
    assert FolderLock(tmp_path).took_over == dead.pid


def test_every_write_failure_is_one_error_naming_the_file(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(OutputWriteError, match=r"cannot write '.*report.json': '.*not-a-folder' is a file, not a folder; nothing there"):
        atomic_write_text(blocker / "report.json", "{}")
    with pytest.raises(OutputWriteError, match=r"cache_dir='.*' is invalid: allowed a folder this process can "
                                               r"write \('.*not-a-folder' is a file, not a folder"):
        check_writable(blocker / "cache" / "deeper", "cache_dir")
    check_writable(tmp_path / "new" / "deeper", "output")  # a folder to be made below a writable one
    assert not (tmp_path / "new").exists()
    assert isinstance(OutputWriteError("x"), ValueError)  # every front end reports it in one line


def test_a_refused_run_frees_the_folder_at_once(tmp_path, monkeypatch):
    """A run refused after it took the lock (here: the check under the lock finds that another run
    finished there meanwhile) releases it before the error reaches the caller, who may keep the
    traceback (a ComfyUI server does)."""
    from segmented_checkpointing.engine.config import ConfigError, TrainConfig
    from segmented_checkpointing.engine.train import loop

    def finished_meanwhile(config):
        assert (tmp_path / LOCK_FILE).read_text()  # called holding the lock
        raise ConfigError("output holds one")

    monkeypatch.setattr(loop, "check_output", finished_meanwhile)
    with pytest.raises(ConfigError, match="holds one") as refused:
        loop.TrainingRun(TrainConfig.create(output=str(tmp_path), resolution=32, steps=1), log=lambda line: None)
    FolderLock(tmp_path).release()  # free, although the traceback still references the refused run
    assert refused.traceback is not None
