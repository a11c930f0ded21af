"""Resume checks what its options point at: images added to or removed from the data folder, a
changed caption or a replaced model file are refused before any model is built (or, with
``on_data_change=new_epoch``, continued from a fresh epoch and recorded in the report)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from helpers import refuse_to_build_models
from safetensors.torch import save_file

from segmented_checkpointing.engine.config import ConfigError, TrainConfig
from segmented_checkpointing.engine.data.fingerprint import data_changes, input_changes, input_fingerprint
from segmented_checkpointing.engine.data.folder import write_sample_dataset
from segmented_checkpointing.engine.train.checks import ResumeWarning
from segmented_checkpointing.engine.train.loop import train
from segmented_checkpointing.engine.train.state import load_state

QUIET = {"log": lambda line: None}


def _config(tmp_path, **changes) -> TrainConfig:
    settings = {"output": str(tmp_path / "run"), "resolution": 32, "steps": 2, "batch_size": 2,
                "data": str(tmp_path / "data"), **changes}
    return TrainConfig.create(**settings)


@pytest.fixture
def trained(tmp_path):
    """A 2-step run on the six sample photos (3 steps per epoch), state saved."""
    write_sample_dataset(tmp_path / "data")
    train(_config(tmp_path), **QUIET)
    return tmp_path


def _refused(tmp_path, monkeypatch, **changes) -> str:
    refuse_to_build_models(monkeypatch, "the changed inputs were named")
    with pytest.raises(ConfigError) as info:
        train(_config(tmp_path, steps=4, resume=True, **changes), **QUIET)
    return str(info.value)


def test_images_added_to_the_data_folder_refuse_the_resume(trained, monkeypatch):
    data = trained / "data"
    shutil.copy(data / "coffee.png", data / "coffee2.png")
    shutil.copy(data / "rocket.png", data / "rocket2.png")
    message = _refused(trained, monkeypatch)
    assert message.startswith(f"resume: the data in {data} changed since the state of step 2 was saved: "
                              "2 images added (coffee2.png, rocket2.png); the saved epoch position would skip or "
                              "repeat images. Allowed: the same data, or on_data_change=new_epoch")


def test_an_image_removed_or_a_caption_changed_refuses_the_resume(trained, monkeypatch):
    data = trained / "data"
    (data / "camera.png").unlink()
    (data / "chelsea.txt").write_text("a different caption\n")
    message = _refused(trained, monkeypatch)
    assert "was saved: 1 removed (camera.png), 1 image or caption changed (chelsea.png);" in message


def test_new_epoch_continues_from_a_fresh_epoch_and_the_report_says_why(trained):
    data = trained / "data"
    (data / "camera.png").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(_config(trained, steps=4, resume=True, on_data_change="new_epoch"), **QUIET)
    said = [str(w.message) for w in caught if issubclass(w.category, ResumeWarning)]
    assert len(said) == 1 and "1 removed (camera.png)" in said[0] and "from epoch 1" in said[0]
    assert result.report["resume"] == {"data_changed": ["1 removed (camera.png)"], "from_step": 2, "fresh_epoch": 1}
    # 5 images in batches of 2 from a fresh epoch 1: steps 3 and 4 are its first two batches
    assert load_state(trained / "run").data_position == {"epoch": 1, "index": 4}
    assert set(load_state(trained / "run").inputs["data"]) == {"astronaut.png", "coffee.png", "chelsea.png",
                                                                 "rocket.png", "hubble_deep_field.png"}


def test_the_same_inputs_resume_and_an_old_state_without_a_fingerprint_is_not_refused(trained):
    assert not any(input_changes(load_state(trained / "run").inputs, input_fingerprint(_config(trained).data, _config(trained).model)))
    assert input_changes({}, input_fingerprint(_config(trained).data, _config(trained).model)) == ([], [])  # saved before fingerprints


def test_a_model_file_replaced_under_its_name_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, path)
    config = TrainConfig.create(output=str(tmp_path / "run"), model_file=str(path), vae_path=str(tmp_path))
    before = input_fingerprint(config.data, config.model)
    save_file({"w": torch.zeros(4, 5)}, path)  # same name, other tensors
    _, model = input_changes(before, input_fingerprint(config.data, config.model))
    assert len(model) == 1 and model[0].startswith("model_file is not what the saved run trained on (model.safetensors: ")
    assert model[0].count(" bytes, header ") == 2


def test_data_changes_name_the_first_files_then_count_the_rest():
    saved = {f"{i}.png": "1:1:a" for i in range(3)}
    now = {**saved, **{f"new{i}.png": "1:1:a" for i in range(5)}}
    assert data_changes(saved, now) == ["5 images added (new0.png, new1.png, new2.png and 2 more)"]
    assert data_changes(saved, saved) == []


def test_the_data_folder_spelled_otherwise_or_moved_with_its_content_resumes(trained, monkeypatch):
    """The fingerprint compares the folder's content, so a trailing slash, a relative path or the
    same images in a moved folder resume; the text of the option is not compared."""
    monkeypatch.chdir(trained)
    train(_config(trained, steps=3, resume=True, data="data/"), **QUIET)
    shutil.copytree(trained / "data", trained / "moved")
    result = train(_config(trained, steps=4, resume=True, data=str(trained / "moved")), **QUIET)
    assert len(result.history) == 4 and result.report["resume"] is None
