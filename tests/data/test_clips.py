"""Video LoRAs on clips: a folder of mp4 clips + an image trains the video families at their frame
rule, every schedule gives the no-checkpoint gradients on multi-frame latents, frame buckets never
mix in a batch, random windows resume exactly, clips cut short train on the frames before the cut
(counted), and bad clips are refused before any model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from clips import clip_folder, cut_clip, pan_frames, write_animated, write_mp4
from helpers import MODES, full_and_resumed, refuse_to_build_models
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.data.buckets import latents_for, shape_classes
from segmented_checkpointing.engine.data.checks import check_dataset
from segmented_checkpointing.engine.data.folder import DatasetError, DataWarning
from segmented_checkpointing.engine.data.video import frame_indices, load_clip, probe_clip
from segmented_checkpointing.engine.families import TextBatch, get_family
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.train import step as step_module
from segmented_checkpointing.engine.train.checks import check_run
from segmented_checkpointing.engine.train.loop import train

QUIET = {"log": lambda line: None}
FRAMES = {"wan": 5, "hunyuanvideo": 5, "ltxvideo": 9}


@pytest.fixture(scope="module")
def clip_data(tmp_path_factory):
    """3 mp4 clips (9, 10, 12 frames, 80x64 at 8 fps) and one photo, captioned."""
    return clip_folder(tmp_path_factory.mktemp("clips") / "data", lengths=(9, 10, 12))


def _config(data, out, family, **changes):
    options = {"family": family, "output": str(out), "data": str(data), "resolution": 64, "steps": 2,
               "lora": LoraSettings(rank=4, alpha=4.0), "timing_warmup_steps": 0, "num_frames": FRAMES.get(family, 1)}
    return TrainConfig.create(**{**options, **changes})


def _cache(result):
    (path,) = (result.lora_path.parent / "cache").glob("cache-*.safetensors")
    return load_file(path)


@pytest.fixture(scope="module")
def runs(clip_data, tmp_path_factory):
    """One 2-step run per video family on the clip folder (read by several tests)."""
    root = tmp_path_factory.mktemp("runs")
    return {family: train(_config(clip_data, root / family, family), **QUIET) for family in FRAMES}


@pytest.mark.parametrize("family", sorted(FRAMES))
def test_video_families_train_on_clips_and_an_image(runs, family):
    result = runs[family]
    rule = get_family(family).frames
    shapes = {shape[1]: len(rows) for shape, rows in shape_classes(_cache(result))}
    assert shapes == {rule.latent_frames(FRAMES[family]): 3, 1: 1}  # 3 clips at F', the photo at 1
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    report = json.loads(result.report_path.read_text())["dataset"]
    assert report["clips"] == 3 and report["frames"]["samples_per_count"] == {str(FRAMES[family]): 3, "1": 1}
    assert report["lossy"]["clip_skipped"] == 0


def test_the_cached_window_is_the_clip_s_frames_encoded(clip_data, runs):
    """The cache's latents of a clip are its first 5 frames through the VAE, as encoded by hand."""
    from segmented_checkpointing.engine.data.cache import encode_latents
    from segmented_checkpointing.engine.data.video import load_clip
    from segmented_checkpointing.engine.model.bundle import build_preset

    result = runs["wan"]
    bundle = build_preset("wan", seed=result.report["config"]["seed"])
    pixels = load_clip(clip_data / "clip0.mp4", [0, 1, 2, 3, 4], (64, 64))[None]
    assert pixels.shape == (1, 3, 5, 64, 64)
    by_hand = encode_latents(bundle.vae, pixels, True)
    cache = _cache(result)
    rows = [r for shape, rows in shape_classes(cache) for r in rows if shape[1] == 2]
    assert by_hand.shape == (1, 16, 2, 8, 8)
    assert torch.allclose(latents_for(cache, rows[:1]), by_hand, atol=1e-6)


def _gradients(family_name, schedule, latents, text):
    family = get_family(family_name)
    torch.manual_seed(0)
    model = family.model_cls()(**family.tiny_config)
    add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), family.lora_targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    runner = SegmentRunner(model, family, effective_plan(family, schedule, count_blocks(family, model),
                                                         warn=False)).install()
    sigmas = torch.full((latents.shape[0],), 0.6)
    output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
    loss = (family.read_output(model, output, latents).float() - latents).pow(2).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


SCHEDULES = {"per-block": MODES["layer"], "interval2": MODES["interval2"],
             "interval2-stride4": MODES["interval2-stride4"],
             "unsloth": CheckpointSchedule(gradient_checkpointing_backend="unsloth")}


@pytest.mark.parametrize("family", sorted(FRAMES))
def test_every_schedule_gives_the_no_checkpoint_gradients_on_clip_latents(runs, family):
    cache = _cache(runs[family])
    shape, rows = shape_classes(cache)[0]
    assert shape[1] > 1  # multi-frame latents
    text = TextBatch(cache["text_seq"][rows[:1]], cache["text_mask"][rows[:1]],
                     cache["text_pooled"][rows[:1]] if "text_pooled" in cache else None)
    latents = latents_for(cache, rows[:1])
    loss, reference = _gradients(family, MODES["none"], latents, text)
    for name, schedule in SCHEDULES.items():
        got_loss, grads = _gradients(family, schedule, latents, text)
        assert abs(got_loss - loss) <= 1e-6, name
        assert grads.keys() == reference.keys()
        worst = max((grads[k] - reference[k]).abs().max().item() for k in grads)
        assert worst <= 1e-6, (name, worst)
        assert any(g.abs().sum() > 0 for g in grads.values())


def test_runs_under_every_schedule_give_equal_losses(clip_data, tmp_path):
    """The whole run (cache, sampler, noise, optimizer) on Wan clips: per-step losses of each schedule."""
    def losses(name, schedule):
        config = _config(clip_data, tmp_path / name, "wan", steps=2).replace(schedule=schedule)
        return [h["loss"] for h in train(config, **QUIET).history]

    reference = losses("none", MODES["none"])
    for name, schedule in SCHEDULES.items():
        assert losses(name, schedule) == pytest.approx(reference, abs=1e-6), name


def test_frame_buckets_never_mix_in_a_batch(clip_data, tmp_path, monkeypatch):
    """frame_buckets 5, 9: clips of 9+ frames go to 9; batches of 2 take rows of one frame count."""
    shapes = []

    def recording(cache, rows):
        out = latents_for(cache, rows)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(step_module, "latents_for", recording)
    result = train(_config(clip_data, tmp_path / "b", "wan", steps=4, batch_size=2, frame_buckets=(5, 9)), **QUIET)
    frames = json.loads(result.report_path.read_text())["dataset"]["frames"]
    assert frames["samples_per_count"] == {"9": 3, "1": 1}
    assert {s[2] for s in shapes} == {3, 1} and all(s[0] <= 2 for s in shapes)


def test_uniform_spreads_frames_and_frame_rate_resamples(clip_data):
    info = probe_clip(clip_data / "clip2.mp4")  # 12 frames at 8 fps
    assert (info.frames, info.fps) == (12, 8.0)
    assert frame_indices(info, 5, None, "uniform") == [0, 3, 6, 8, 11]
    assert frame_indices(info, 5, 4.0, "first") == [0, 2, 4, 6, 8]  # every other frame at half the rate
    with pytest.raises(ValueError, match="cannot give 9"):
        frame_indices(info, 9, 4.0, "first")  # 6 frames at 4 fps


def test_random_windows_resume_exactly(clip_data, tmp_path):
    """frame_sampling random, stopped after step 3 of 6 and resumed: the same windows, losses and LoRA."""
    def config(name, **changes):
        return _config(clip_data, tmp_path / name, "wan", steps=6, save_every=1, frame_sampling="random", **changes)

    full, resumed = full_and_resumed(config, 3, **QUIET)
    assert [h["loss"] for h in full.history] == pytest.approx([h["loss"] for h in resumed.history], abs=1e-6)
    a, b = load_file(full.lora_path), load_file(resumed.lora_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    frames = json.loads(full.report_path.read_text())["dataset"]["frames"]
    assert frames["frame_sampling"] == "random" and frames["windows_encoded"] > 0  # drawn windows were encoded


def test_an_animated_webp_is_a_clip_and_a_still_gif_an_image(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_animated(folder / "moving.webp", pan_frames(6))
    pan_frames(1)[0].save(folder / "still.gif")
    samples = {s.image.name: s for s in check_dataset(folder).samples}
    assert samples["moving.webp"].clip and samples["moving.webp"].frames == 6
    assert not samples["still.gif"].clip


# ---- refusals: one line, before any model ------------------------------------------------------

def _refused(config, monkeypatch):
    refuse_to_build_models(monkeypatch, "the frames were checked")
    with pytest.raises((ConfigError, DatasetError)) as info:
        check_run(config)
    return str(info.value)


def test_a_count_breaking_the_rule_and_frames_on_an_image_family_are_refused(clip_data, tmp_path, monkeypatch):
    message = _refused(_config(clip_data, tmp_path / "r", "wan", num_frames=16), monkeypatch)
    assert message == "num_frames=16 is invalid for wan: allowed 4k+1 (13, 17, ...)"
    message = _refused(_config(clip_data, tmp_path / "r", "ltxvideo", frame_buckets=(9, 12)), monkeypatch)
    assert message.startswith("frame_buckets=12 is invalid for ltxvideo: allowed 8k+1 (9, 17")
    message = _refused(_config(clip_data, tmp_path / "r", "flux", num_frames=5), monkeypatch)
    assert message.startswith("num_frames=5 is invalid for flux: allowed 1 (flux is an image family")


def test_every_clip_too_short_is_refused_naming_min_frames(clip_data, tmp_path, monkeypatch):
    message = _refused(_config(clip_data, tmp_path / "r", "wan", num_frames=13), monkeypatch)
    assert "every clip (3) is too short: min_frames=13" in message and "longest clip gives 12 frames" in message


@pytest.mark.parametrize(("name", "options", "intra"), [
    ("pan.mkv", None, False),  # frames stated by its duration; B-frames: a cut can lose a frame whose successors decode
    ("pan.mp4", {"movflags": "faststart"}, True),  # frames stated by its index; the decoder refuses the cut packet
    ("pan.avi", None, True)])  # frames stated by its header; the demuxer flags the cut packet corrupt
def test_a_clip_cut_short_keeps_exactly_the_frames_before_the_cut(tmp_path, name, options, intra):
    """A 12-frame clip cut inside each of its packets in turn: the frames before the damage decode as
    the whole clip's, and the clip says it ends early; cut inside its first packet it is refused."""
    whole = write_mp4(tmp_path / name, pan_frames(12, (32, 32)), options=options, intra=intra)
    reference = load_clip(whole, list(range(12)), (32, 32))
    counts = []
    for packet in range(12):
        cut = cut_clip(whole, tmp_path / f"cut{packet}{whole.suffix}", packet)
        if packet == 0:
            with pytest.raises(DatasetError, match=f"clip '{cut}' (could not be decoded|is truncated)"):
                probe_clip(cut)
            continue
        info = probe_clip(cut)
        counts.append(info.frames)
        assert info.ended_early.startswith(f"{info.frames} of the 12 frames its container states decode")
        assert torch.equal(load_clip(cut, list(range(info.frames)), (32, 32)), reference[:, :info.frames])
    assert counts == (list(range(1, 12)) if intra else sorted(counts)) and 1 <= counts[0] and counts[-1] < 12


def test_a_gif_cut_short_keeps_exactly_the_frames_before_the_cut(tmp_path):
    """An 8-frame GIF cut at 60% of its bytes: the frames before the cut decode as the whole GIF's."""
    whole = write_animated(tmp_path / "pan.gif", pan_frames(8, (32, 32)))
    cut = tmp_path / "cut.gif"
    cut.write_bytes(whole.read_bytes()[: len(whole.read_bytes()) * 6 // 10])
    info = probe_clip(cut)
    assert 1 <= info.frames < 8 and info.ended_early.startswith(f"{info.frames} frames decode; decoding stopped: ")
    assert torch.equal(load_clip(cut, list(range(info.frames)), (32, 32)),
                       load_clip(whole, list(range(info.frames)), (32, 32)))


def test_short_clips_are_skipped_and_a_clip_cut_short_trains_on_its_frames_counted(clip_data, tmp_path):
    """min_frames=10: the 9-frame clip is skipped and counted; a 12-frame clip cut in its 11th packet
    trains on its 10 frames, named in ``dataset.lossy_files.clip_truncated`` and in one warning."""
    data = shutil.copytree(clip_data, tmp_path / "data")
    whole = write_mp4(tmp_path / "whole.mkv", pan_frames(12, (80, 64), "rocket"), intra=True)
    cut_clip(whole, data / "cut.mkv", 10)
    (data / "cut.txt").write_text("a camera pan over a rocket")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(_config(data, tmp_path / "out", "wan", steps=1, num_frames=5, min_frames=10), **QUIET)
    dataset = json.loads(result.report_path.read_text())["dataset"]
    assert dataset["lossy"]["clip_truncated"] == 1 and dataset["lossy"]["clip_skipped"] == 1
    assert dataset["lossy_files"]["clip_skipped"] == ["clip0.mp4 (9 frames, fewer than min_frames=10)"]
    assert dataset["lossy_files"]["clip_truncated"] == ["cut.mkv (10 of the 12 frames its container states decode)"]
    assert dataset["frames"]["samples_per_count"] == {"5": 3, "1": 1}  # clip1, clip2, cut.mkv at 5; the photo
    said = [str(w.message) for w in caught if issubclass(w.category, DataWarning) and "clip_truncated" in str(w.message)]
    assert said == ["data: 1 clips end before the frames their file states (each trains on the frames that decode) "
                    "(clip_truncated): cut.mkv (10 of the 12 frames its container states decode)"]


def test_a_truncated_mp4_is_refused_by_the_cli_naming_the_file(clip_data, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    data = (clip_data / "clip2.mp4").read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 3])
    done = subprocess.run([sys.executable, "-m", "segmented_checkpointing.cli", "train", "--family", "wan", "--data",
                           str(folder), "--num-frames", "5", "--output", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "cut.mp4" in last and "could not be decoded" in last
