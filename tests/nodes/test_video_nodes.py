"""Video data through the nodes, in-process: the Dataset node's frame options, and a clip given as a
ComfyUI IMAGE batch trains exactly as the same clip file does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from clips import pan_frames, write_mp4
from helpers import verdict
from safetensors.torch import load_file

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.data.comfy_data import ComfyDataError
from segmented_checkpointing.engine.families import TextBatch, get_family
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.graph import run_node

RUN = dict(steps=2, learning_rate=1e-3, lr_scheduler="constant", batch_size=1, gradient_accumulation_steps=1, seed=0,
           resume=False)


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    folder = tmp_path / "input" / "clip"
    folder.mkdir(parents=True)
    write_mp4(folder / "pan.mp4", pan_frames(5, (64, 64)))
    (folder / "pan.txt").write_text("a camera pan over a photo")
    return tmp_path


def _comfy_frames(path) -> torch.Tensor:
    """The frames as ComfyUI's Load Video -> Get Video Components gives them: PyAV RGB / 255, (F, H, W, 3)."""
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    return torch.from_numpy(np.stack(frames)).float() / 255.0


def _schedule():
    (schedule,) = NODES["SegCkptSchedule"].execute(
        family="wan", gradient_checkpointing=True, gradient_checkpointing_backend="torch",
        gradient_checkpointing_interval=0, gradient_checkpointing_segment_stride=0,
        gradient_checkpointing_offload_attention=False, gradient_checkpointing_offload_pin_memory_max_buckets=0)
    return schedule


def test_an_image_batch_of_frames_trains_as_the_clip_file_does(base):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("wan", "(tiny preset)", 0)
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("clip", 64, num_frames=5)
    assert dataset.num_frames == 5
    with torch.inference_mode():  # as ComfyUI runs nodes
        (from_folder,) = run_node(NODES["SegCkptTrainLoRA"], model, _schedule(), dataset=dataset, run_name="folder",
                                  node_id="1", **RUN)
        frames = _comfy_frames(base / "input" / "clip" / "pan.mp4")
        (from_batch,) = run_node(NODES["SegCkptTrainLoRA"], model, _schedule(), images=frames,
                                 caption="a camera pan over a photo", run_name="batch",
                                 node_id="2", **RUN)
    (cache_file,) = (base / "output" / "segckpt" / "cache").glob("cache-*.safetensors")
    folder_latents = load_file(cache_file)["latents"]
    loaded = model.load()
    encode = api.batch_encoder(loaded.family, loaded.vae)
    prepared = api.prepare_image_batch(loaded.family, frames, "a camera pan over a photo", api.DataConfig(resolution=64),
                                       encode, loaded.encode_text)
    assert folder_latents.shape == prepared.cache["latents"].shape == (1, 16, 2, 8, 8)
    assert (folder_latents - prepared.cache["latents"]).abs().max().item() <= 1e-6
    assert from_batch.history[0]["loss"] == pytest.approx(from_folder.history[0]["loss"], abs=1e-6)
    assert from_batch.report["dataset"]["frames"] == {"given": 5, "trained": 5, "frame_sampling": "first"}


def test_the_batch_takes_the_most_frames_the_rule_allows_and_refuses_too_few():
    family = get_family("wan")
    shapes = []

    def encode(pixels):
        shapes.append(tuple(pixels.shape))
        return torch.zeros(1, 16, (pixels.shape[2] - 1) // 4 + 1, 8, 8)

    def text(captions):
        return TextBatch(torch.zeros(len(captions), 4, 8), torch.ones(len(captions), 4, dtype=torch.bool))

    frames = torch.rand(7, 48, 40, 3)
    api.prepare_image_batch(family, frames, "x", api.DataConfig(resolution=64), encode, text)
    assert shapes == [(1, 3, 5, 48, 32)]  # 5 of 7 frames (4k+1), 40 px cropped to 32 (multiple 16)
    with pytest.raises(ComfyDataError, match="images holds 7 frames, fewer than num_frames=9"):
        api.prepare_image_batch(family, frames, "x", api.DataConfig(resolution=64, num_frames=9), encode, text)
    with pytest.raises(ComfyDataError, match=r"allowed a ComfyUI IMAGE \(B, H, W, 3\)"):
        api.prepare_image_batch(family, torch.rand(7, 3, 48, 40), "x", api.DataConfig(resolution=64), encode, text)


def test_the_dataset_node_validates_its_frame_options(base):
    dataset_node = NODES["SegCkptImageCaptionDataset"]
    assert verdict(dataset_node, folder="clip", resolution=64, buckets=False, num_frames=5) is True
    assert "frame_sampling='sideways'" in verdict(dataset_node, folder="clip", resolution=64, buckets=False,
                                                  frame_sampling="sideways")
    (dataset,) = dataset_node.execute("clip", 64, frame_buckets="5, 9", frame_rate=0, min_frames=0)
    assert dataset.frame_buckets == (5, 9) and dataset.frame_rate is None and dataset.min_frames is None


def test_train_lora_takes_one_data_source(base):
    message = verdict(NODES["SegCkptTrainLoRA"], run_name="r", dataset=None, images=None)
    assert "dataset and images are connected" in message


def test_the_planner_node_judges_a_clip_dataset_at_its_frames(base):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("wan", "(tiny preset)", 0)
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("clip", 64, num_frames=5)
    with torch.inference_mode():
        shown = run_node(NODES["SegCkptSchedulePlanner"], model, dataset, 1, 1, 0, "plan", 1.0, node_id="3")
    text = shown.result[1]
    assert "train 1x16x2x8x8" in text and "5 frames, 32 tokens" in text  # the clip's 2 latent frames x 16 patches
