"""What a run refuses from its options and the disk alone, before any heavy import (engine/data/precheck.py,
run first by ``check_run``): an output folder inside the data, a folder another live run holds. Which
modules the refusals import is asserted in tests/test_startup.py."""

from __future__ import annotations

import pytest

from segmented_checkpointing.engine.config import ConfigError, TrainConfig
from segmented_checkpointing.engine.files.lock import LOCK_FILE, FolderInUseError, FolderLock
from segmented_checkpointing.engine.train.checks import check_run


@pytest.mark.parametrize("output", ["data", "data/out", "data/deeper/out", "link-to-data/out"])
def test_an_output_folder_that_is_the_data_folder_or_inside_it_is_refused(tmp_path, output):
    """Issue 34: the run's LoRA, state, previews and cache would land among the training images."""
    (tmp_path / "data").mkdir()
    (tmp_path / "link-to-data").symlink_to(tmp_path / "data", target_is_directory=True)
    config = TrainConfig.create(data=str(tmp_path / "data"), output=str(tmp_path / output), resolution=32)
    with pytest.raises(ConfigError, match=rf"^output='{tmp_path / output}' is invalid with data='{tmp_path / 'data'}': "
                                          "allowed a folder outside the data folder"):
        check_run(config)
    with pytest.raises(ValueError, match="holds no image"):  # beside it: the next check, the empty data, answers
        check_run(config.replace(output=str(tmp_path / "data-out")))


def test_a_resume_into_a_folder_a_live_run_holds_names_the_holder_before_the_resume_checks(tmp_path):
    """Issue 34: the resume checks answered first ("only when training_state.safetensors exists": the
    live run had saved nothing yet), so the user looked for a missing file instead of the other run."""
    out = tmp_path / "run"
    holder = FolderLock(out, "segckpt train")
    record = (out / LOCK_FILE).read_text()
    try:
        with pytest.raises(FolderInUseError, match=rf"^output='{out}' is in use by another run in this process "
                                                   r"\(running segckpt train since .*\): one run per output folder"):
            check_run(TrainConfig.create(output=str(out), resume=True, resolution=32))
        assert (out / LOCK_FILE).read_text() == record  # asking took nothing and wrote nothing
    finally:
        holder.release()
    with pytest.raises(ConfigError, match=r"resume=True is invalid: allowed only when .*training_state"):
        check_run(TrainConfig.create(output=str(out), resume=True, resolution=32))  # free again: the next check
    check_run(TrainConfig.create(output=str(tmp_path / "never-used"), resolution=32))
    assert not (tmp_path / "never-used").exists()  # a folder not made yet stays so
