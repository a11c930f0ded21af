"""Validation previews: when they are due, that the sampler integrates the flow the families train
on, that the decoder undoes the cache's normalisation, and that previews during a run are written,
reported and leave the training itself unchanged."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.cache import encode_latents
from segmented_checkpointing.engine.families import TextBatch
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun
from segmented_checkpointing.engine.train.previews import PreviewSource, Sampling, previews_at, sample, vae_decoder


@pytest.mark.parametrize("every, last, due", [(0, 5, []), (2, 5, [2, 4, 5]), (5, 5, [5]), (7, 5, [5]),
                                              (1, 3, [1, 2, 3])])
def test_previews_are_due_every_n_steps_and_at_the_last(every, last, due):
    assert [s for s in range(1, last + 1) if previews_at(s, every, last)] == due


class _ExactVelocity(torch.nn.Module):
    """The flow-matching velocity of one known sample ``x0``: on the path
    ``x = (1 - sigma) x0 + sigma noise`` it is ``noise - x0 = (x - x0) / sigma``."""

    def __init__(self, x0):
        super().__init__()
        self.x0 = x0

    def forward(self, x, sigma):
        return (x - self.x0) / sigma.view(-1, *([1] * (x.ndim - 1)))


def test_the_sampler_integrates_the_trained_flow_to_its_data():
    """Euler steps along the exact velocity land on ``x0`` whatever the step count: the sign, the
    sigmas and the update are those of the families' training target (noise - latents)."""
    x0 = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    family = SimpleNamespace(make_inputs=lambda model, x, sigma, text: {"x": x, "sigma": sigma},
                             read_output=lambda model, output, x: output)
    source = PreviewSource(TextBatch(torch.zeros(2, 1, 1), torch.ones(2, 1, dtype=torch.bool)), lambda z: z,
                           (4, 3, 3), ["a", "b"])
    for steps in (1, 4, 8):
        out = sample(_ExactVelocity(x0), family, source, Sampling(steps, seed=0), device=torch.device("cpu"),
                     autocast=contextlib.nullcontext)
        torch.testing.assert_close(out, x0, atol=1e-5, rtol=0)


def test_the_decoder_undoes_the_caches_normalisation():
    vae = build_preset("flux").vae.eval()
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        latents = encode_latents(vae, pixels, video=False)
        raw = vae.encode(pixels).latent_dist.mode()
        expected = ((vae.decode(raw).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(vae_decoder(vae, torch.device("cpu"))(latents), expected, atol=1e-5, rtol=0)


def _config(tmp_path, name, **changes):
    base = TrainConfig.create(family="flux", output=str(tmp_path / name), resolution=32, steps=3, batch_size=2,
                       lora=LoraSettings(rank=4, alpha=4.0), timing_warmup_steps=0, data=str(tmp_path / "data"))
    return base.replace(**changes)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("previews")
    write_sample_dataset(root / "data")
    return root


def _run(config):
    lines = []
    with pytest.warns(UserWarning):  # the stand-in text embedder's notice
        run = TrainingRun(config, bundle=build_preset("flux"), log=lines.append)
        records = list(run)
    return run, records, lines


def test_previews_are_written_and_reported_and_leave_training_unchanged(data_dir):
    plain, plain_records, _ = _run(_config(data_dir, "plain"))
    config = _config(data_dir, "previews", validation_every=2, validation_prompts=("a cat", "a dog"),
                     validation_num_inference_steps=3, validation_frames=5)  # an image family: PNGs all the same
    run, records, lines = _run(config)
    assert [r.loss for r in records] == [r.loss for r in plain_records]  # previews draw no training RNG
    trained, reference = load_file(run.output / "lora.safetensors"), load_file(plain.output / "lora.safetensors")
    assert all(torch.equal(trained[k], reference[k]) for k in reference)
    assert [r.previews for r in records] == [
        [], ["previews/step_00002_prompt0.png", "previews/step_00002_prompt1.png"],
        ["previews/step_00003_prompt0.png", "previews/step_00003_prompt1.png"]]
    for name in records[1].previews + records[2].previews:
        with Image.open(run.output / name) as image:
            assert image.size == (32, 32) and image.mode == "RGB"
    assert any("previews previews/step_00002_prompt0.png" in line for line in lines)
    report = json.loads((run.output / "report.json").read_text())
    validation_peak = report["memory"]["validation_peak_bytes"]
    assert validation_peak > 0 and report["steps"][1]["previews"] == records[1].previews
    assert report["totals"]["peak_bytes"] >= validation_peak
    plain_report = json.loads((plain.output / "report.json").read_text())
    assert plain_report["memory"]["validation_peak_bytes"] == 0


def test_an_epsilon_family_says_previews_are_off(data_dir):
    config = _config(data_dir, "pixart", validation_every=1, steps=1).replace(family="pixart")
    lines = []
    with pytest.warns(UserWarning):
        run = TrainingRun(config, bundle=build_preset("pixart"), log=lines.append)
        records = list(run)
    assert records[0].previews == [] and not (run.output / "previews").exists()
    assert any("previews: off (pixart trains on the epsilon objective" in line for line in lines)


@pytest.mark.parametrize("key, value", [("validation_every", -1), ("validation_num_inference_steps", 0),
                                        ("validation_prompts", ["x"] * 17)])
def test_bad_preview_settings_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key):
        TrainConfig.from_dict({key: value})


def test_a_comfyui_video_vae_preview_shows_each_samples_first_frame():
    """ComfyUI's Wan VAE decodes (B, C, T, h, w) latents to (B, T, H, W, 3) frames: the preview
    takes frame 0 of each sample, as (B, 3, H, W)."""
    from segmented_checkpointing.engine.data.comfy_data import PreparedData
    from segmented_checkpointing.engine.families import get_family
    from segmented_checkpointing.engine.train.previews import comfy_preview_source

    frames = torch.rand(2, 3, 16, 16, 3)
    seen = []

    class VideoVAE:
        def decode(self, latents):
            seen.append(tuple(latents.shape))
            return frames

    cache = {"latents": torch.zeros(2, 16, 1, 2, 2), "text_seq": torch.zeros(2, 4, 8),
             "text_mask": torch.ones(2, 4, dtype=torch.bool)}
    source = comfy_preview_source(get_family("wan"), PreparedData("wan", cache, {}), VideoVAE())
    images = source.decode(torch.zeros(2, 16, 1, 2, 2))
    assert seen == [(2, 16, 1, 2, 2)] and images.shape == (2, 3, 16, 16)
    assert torch.equal(images, frames[:, 0].movedim(-1, 1))
