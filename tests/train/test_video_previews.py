"""Previews that move: a video family's previews are animated WebP clips of ``validation_frames``
frames (default: the family's smallest count above 1), decoded by its real video VAE; an image
family keeps PNGs and ignores ``validation_frames``; the node's preview event lists the clip."""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.cache import encode_latents
from segmented_checkpointing.engine.data.limits import check_frames
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.bundle import build_preset, tiny_vae
from segmented_checkpointing.engine.train.loop import TrainingRun
from segmented_checkpointing.engine.train.previews import encode_webp, preview_latent_shape, vae_decoder
from segmented_checkpointing.nodes.environment import Host
from segmented_checkpointing.nodes.live import LiveRun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from clips import clip_folder  # noqa: E402  (tests/clips.py: small real mp4 clips)


@pytest.mark.parametrize("family, cached, frames, expected", [
    ("wan", (16, 1, 4, 4), None, (16, 2, 4, 4)),  # an image's latent in the cache; default 5 frames
    ("wan", (16, 2, 4, 4), 9, (16, 3, 4, 4)),
    ("ltxvideo", (128, 1, 1, 1), None, (128, 2, 1, 1)),  # 8k+1: default 9 frames
    ("flux", (16, 4, 4), 5, (16, 4, 4)),  # an image family ignores validation_frames
])
def test_the_preview_latent_has_the_clips_latent_frames(family, cached, frames, expected):
    assert preview_latent_shape(get_family(family), cached, frames) == expected


def test_validation_frames_outside_the_frame_rule_are_refused_for_video_families_only(tmp_path):
    config = TrainConfig.create(family="wan", output=str(tmp_path / "o"), data=str(tmp_path), validation_frames=4)
    with pytest.raises(ConfigError, match="validation_frames"):
        check_frames(config.model, config.data, config.validation.validation_frames)
    flux = config.replace(family="flux")
    check_frames(flux.model, flux.data, flux.validation.validation_frames)  # one frame per image: nothing to refuse


@pytest.mark.parametrize("family", ["wan", "hunyuanvideo", "ltxvideo"])
def test_the_decoder_undoes_the_caches_normalisation_of_a_clip(family):
    """``vae_decoder`` of ``encode_latents``' clip latents equals the VAE's own decoding of the raw
    latents: ``(1, 3, F, H, W)``, ``F`` the rule's smallest clip (LTX-Video: its mean/std buffers)."""
    rule = get_family(family).frames
    torch.manual_seed(0)
    vae = tiny_vae(get_family(family)).eval()
    if "latents_mean" in dict(vae.named_buffers(recurse=False)):
        vae.latents_mean.copy_(torch.randn_like(vae.latents_mean))
        vae.latents_std.copy_(torch.rand_like(vae.latents_std) + 0.5)
    frames, side = rule.pixel_frames(2), 32 if rule.temporal == 4 else 64
    pixels = torch.rand(1, 3, frames, side, side) * 2 - 1
    with torch.no_grad():
        latents = encode_latents(vae, pixels, video=True)
        encoded = vae.encode(pixels)
        raw = encoded.latent_dist.mode() if hasattr(encoded, "latent_dist") else encoded.latent
        expected = ((vae.decode(raw).sample + 1) / 2).clamp(0, 1)
    decoded = vae_decoder(vae, torch.device("cpu"))(latents)
    assert latents.shape[2] == 2 and decoded.shape == (1, 3, frames, side, side)
    torch.testing.assert_close(decoded, expected, atol=1e-4, rtol=0)


def test_a_clip_is_an_animated_looping_webp_at_its_frame_rate():
    clip = torch.rand(3, 5, 16, 24)
    with Image.open(io.BytesIO(encode_webp(clip, fps=8))) as image:
        assert image.format == "WEBP" and image.is_animated and image.n_frames == 5 and image.size == (24, 16)
        image.seek(1)
        image.load()  # Pillow reads a frame's duration with its pixels
        assert image.info["duration"] == 125 and image.info["loop"] == 0


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-previews")
    clip_folder(root / "data")
    config = TrainConfig.create(family="wan", output=str(root / "out"), data=str(root / "data"), resolution=32,
                                steps=2, batch_size=1, num_frames=5, lora=LoraSettings(rank=4, alpha=4.0),
                                timing_warmup_steps=0, validation_every=1, validation_frames=5,
                                validation_num_inference_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-in text embedder's notice
        run = TrainingRun(config, bundle=build_preset("wan"), log=lambda line: None)
        records = list(run)
    return root, config, run, records


def test_a_video_family_previews_clips_as_animated_webps(wan_run):
    _, _, run, records = wan_run
    assert [r.previews for r in records] == [["previews/step_00001_prompt0.webp"],
                                             ["previews/step_00002_prompt0.webp"]]
    for name in records[0].previews + records[1].previews:
        with Image.open(run.output / name) as image:
            assert image.format == "WEBP" and image.is_animated and image.n_frames == 5
            assert image.size == (32, 32)  # the run's resolution
            image.seek(1)
            image.load()
            assert image.info["duration"] == 62  # no frame_rate: 16 fps
    report = json.loads((run.output / "report.json").read_text())
    assert [s["previews"] for s in report["steps"]] == [r.previews for r in records]


def test_the_nodes_preview_event_lists_the_clip(wan_run):
    root, config, _, records = wan_run
    sent = []
    host = Host(input_dir=root, diffusers_dirs=[], loras_dir=root, output_dir=root,
                progress=lambda node, total: lambda *a, **k: None, interrupted=lambda: False,
                send=lambda event, data: sent.append((event, data)))
    LiveRun(host, "7", config).on_step(records[0], config.steps)
    previews = [data for event, data in sent if event == "segckpt.preview"]
    assert previews == [{"node": "7", "step": 1, "images": [
        {"filename": "step_00001_prompt0.webp", "subfolder": "out/previews", "type": "output"}]}]


def test_a_comfyui_video_vae_previews_a_clip_of_validation_frames():
    """With ComfyUI's VAE the clip's latents have ``latent_frames(validation_frames)`` frames and
    the VAE's ``(B, T, H, W, 3)`` frames come back as a clip ``(B, 3, T, H, W)``."""
    from segmented_checkpointing.engine.data.comfy_data import PreparedData
    from segmented_checkpointing.engine.train.previews import comfy_preview_source

    frames = torch.rand(1, 9, 16, 16, 3)

    class VideoVAE:
        def decode(self, latents):
            return frames

    cache = {"latents": torch.zeros(2, 16, 1, 2, 2), "text_seq": torch.zeros(2, 4, 8),
             "text_mask": torch.ones(2, 4, dtype=torch.bool)}
    source = comfy_preview_source(get_family("wan"), PreparedData("wan", cache, {}), VideoVAE(), 9, 8.0)
    assert source.latent_shape == (16, 3, 2, 2) and source.fps == 8.0
    assert torch.equal(source.decode(torch.zeros(1, 16, 3, 2, 2)), frames.movedim(-1, 1))
