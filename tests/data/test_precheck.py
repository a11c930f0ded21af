"""What a run refuses from its options and the disk alone, before any heavy import (engine/data/precheck.py):
an output folder inside the data, a folder another live run holds, a batch larger than the data
(said, not refused). Which modules the refusals import is asserted in tests/test_startup.py."""

from __future__ import annotations

import pytest
import torch

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.config import ConfigError, TrainConfig
from segmented_checkpointing.engine.data.samplers import batch_over_data, describe_batch_over_data
from segmented_checkpointing.engine.files.lock import LOCK_FILE, FolderInUseError, FolderLock, check_free
from segmented_checkpointing.engine.train.checks import check_run


@pytest.mark.parametrize("output", ["data", "data/out", "data/deeper/out", "link-to-data/out"])
def test_an_output_folder_that_is_the_data_folder_or_inside_it_is_refused(tmp_path, output):
    """Issue 34: the run's LoRA, state, previews and cache would land among the training images."""
    (tmp_path / "data").mkdir()
    (tmp_path / "link-to-data").symlink_to(tmp_path / "data", target_is_directory=True)
    config = TrainConfig.create(data=str(tmp_path / "data"), output=str(tmp_path / output))
    with pytest.raises(ConfigError, match=rf"^output='{tmp_path / output}' is invalid with data='{tmp_path / 'data'}': "
                                          "allowed a folder outside the data folder"):
        api.precheck(config)
    with pytest.raises(ValueError, match="holds no image"):  # beside it: the next check, the empty data, answers
        api.precheck(config.replace(output=str(tmp_path / "data-out")))


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
    check_free(out)  # free again
    check_free(tmp_path / "never-used")
    assert not (tmp_path / "never-used").exists()
    with pytest.raises(ConfigError, match=r"resume=True is invalid: allowed only when .*training_state"):
        check_run(TrainConfig.create(output=str(out), resume=True, resolution=32))


def _cache(*shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A cache of one latent shape (``latents``) or of buckets (``bucket_index`` and ``latents.<WxH>``
    per bucket, ``engine/data/buckets.py``); ``shapes``: ``(rows, C, h, w)``."""
    if len(shapes) == 1:
        return {"latents": torch.zeros(shapes[0])}
    index = [b for b, shape in enumerate(shapes) for _ in range(shape[0])]
    keys = {f"latents.{8 * s[3]}x{8 * s[2]}": torch.zeros(s) for s in shapes}
    return {"bucket_index": torch.tensor(index), **keys}


def test_a_batch_larger_than_the_data_says_how_often_each_image_repeats_per_step():
    assert batch_over_data(_cache((3, 4, 2, 2)), [0, 1, 2], 3) is None
    over = batch_over_data(_cache((3, 4, 2, 2)), [0, 1, 2], 8)
    assert over == {"batch_size": 8, "images_per_epoch": 3, "repeats_per_step": 2.667, "largest_batch": 8}
    assert describe_batch_over_data(over) == (
        "data: batch_size=8 is larger than the 3 images of an epoch: each image appears 2.667 times in every batch "
        "(the same images' gradients averaged again; fewer images per batch train the same in less time)")
    repeats = batch_over_data(_cache((2, 4, 2, 2)), [0, 0, 1, 1], 6)  # a kohya 2_name folder: 4 per epoch
    assert repeats["images_per_epoch"] == 4 and repeats["repeats_per_step"] == 1.5


def test_buckets_cap_a_batch_larger_than_the_data_at_the_largest_bucket():
    cache = _cache((2, 4, 2, 3), (3, 4, 3, 2))
    over = batch_over_data(cache, [0, 1, 2, 3, 4], 8)
    assert over == {"batch_size": 8, "images_per_epoch": 5, "repeats_per_step": 1.0, "largest_batch": 3}
    assert describe_batch_over_data(over).endswith("batches never mix buckets, so each holds at most 3 images, each "
                                                   "once")
