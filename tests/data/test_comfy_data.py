"""ComfyUI's encoders as the data source (LATENT + CONDITIONING), and the CLI's text encoders.

The ComfyUI formats are built here as ComfyUI 0.3.64 makes them (``nodes.py`` VAEEncode returns
``{"samples": (B, C, H, W)}`` in the VAE's raw space, or ``(B, C, T, H, W)`` for a video VAE;
CLIPTextEncode returns ``[[cond (1, L, D), {"pooled_output": (1, P) or None, ...}]]``, and a
per-image CONDITIONING is a list of such entries, as ComfyUI's TrainLoraNode pairs them).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.configuration_utils import FrozenDict
from helpers import save_tiny_text_encoder, verdict

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.data.cache import encode_latents
from segmented_checkpointing.engine.data.comfy_data import ComfyDataError, comfy_mapped_families, prepare_comfy_data
from segmented_checkpointing.engine.families import TextSpec, get_family
from segmented_checkpointing.engine.families.conditioning import FLUX, WAN21
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.model.text_encoders import (
    TextEncoderError,
    TextEncoderWarning,
    encoder_kind,
    load_text_encoders,
)
from segmented_checkpointing.engine.train.loop import TrainingRun, train
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.graph import GraphError, load_api_graph, run_graph, run_node

QUIET = {"log": lambda line: None}
WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "api" / "train_segmented_lora.api.json"


def _config(tmp_path, name, family="flux", **changes):
    base = TrainConfig.create(family=family, output=str(tmp_path / name), resolution=32, steps=3, batch_size=2,
                       lora=LoraSettings(rank=4, alpha=4.0), timing_warmup_steps=0)
    return base.replace(**changes)


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory):
    """The engine's own data path (sample photos -> VAE -> cache) for 3 steps, per family: its
    losses and the cache it trained on."""
    root, runs = tmp_path_factory.mktemp("comfy"), {}

    def run(family):
        if family not in runs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the stand-in embedder's notice
                training = TrainingRun(_config(root, f"{family}-images", family), bundle=build_preset(family), **QUIET)
                losses = [record.loss for record in training]
            runs[family] = (losses, training.context.cache, root)
        return runs[family]
    return run


def _as_comfy(family_name, cache, *, mask=True):
    """The cache in ComfyUI's formats: raw VAE latents (the latent format's ``process_out``) and one
    CONDITIONING entry per image, with the encoder's attention mask when ``mask``."""
    family = get_family(family_name)
    latent = {"samples": family.comfy_latents.process_out(cache["latents"])}
    conditioning = []
    for i in range(cache["latents"].shape[0]):
        extra = {"pooled_output": cache["text_pooled"][i:i + 1] if "text_pooled" in cache else None}
        if mask:
            extra["attention_mask"] = cache["text_mask"][i:i + 1].long()
        conditioning.append([cache["text_seq"][i:i + 1], extra])
    return latent, conditioning


def _prepare(family_name, latent, conditioning):
    bundle = build_preset(family_name)
    return bundle, prepare_comfy_data(bundle.family, bundle.family.text(bundle.transformer.config), latent,
                                      conditioning)


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "qwenimage"])
def test_comfy_latents_and_conditioning_train_like_the_engines_own_data(family, image_runs, tmp_path):
    """Must-show: 3 steps on LATENT + CONDITIONING give the image path's per-step losses (1e-6)."""
    losses, cache, _ = image_runs(family)
    bundle, prepared = _prepare(family, *_as_comfy(family, cache))
    assert torch.equal(prepared.cache["text_seq"], cache["text_seq"])
    assert torch.equal(prepared.cache["text_mask"], cache["text_mask"])
    assert (prepared.cache["latents"] - cache["latents"]).abs().max() < 1e-6
    result = train(_config(tmp_path, "comfy", family), bundle=bundle, prepared=prepared, **QUIET)
    got = [h["loss"] for h in result.history]
    assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, losses)) <= 1e-6, (got, losses)
    dataset = result.report["dataset"]
    assert dataset["source"] == "ComfyUI LATENT + CONDITIONING" and dataset["images"] == 6
    assert dataset["conditioning"] == "one per image" and result.report["text_encoder"]["kind"] == "comfyui conditioning"


def test_prompts_of_different_lengths_are_padded_and_masked(image_runs):
    """Entries cut to each prompt's real tokens (no mask, as a non-masking encoder gives them) are
    zero-padded to the longest with a False mask."""
    _, cache, _ = image_runs("flux")
    latent, entries = _as_comfy("flux", cache, mask=False)
    lengths = cache["text_mask"].sum(1).tolist()
    short = [[cond[:, :n], extra] for (cond, extra), n in zip(entries, lengths)]
    _, prepared = _prepare("flux", latent, short)
    longest = max(lengths)
    assert prepared.summary["text_tokens"] == longest
    assert torch.equal(prepared.cache["text_mask"], cache["text_mask"][:, :longest])
    assert torch.equal(prepared.cache["text_seq"], cache["text_seq"][:, :longest])


def test_one_conditioning_for_all_images_and_a_latent_list(image_runs):
    _, cache, _ = image_runs("flux")
    latent, entries = _as_comfy("flux", cache)
    _, one = _prepare("flux", latent, entries[:1])
    _, same = _prepare("flux", latent, [entries[0]] * 6)
    assert one.summary["conditioning"] == "one for all images" and same.summary["conditioning"] == "one per image"
    for key in ("latents", "text_seq", "text_mask", "text_pooled"):
        assert torch.equal(one.cache[key], same.cache[key]), key
    batch = latent["samples"]
    _, listed = _prepare("flux", [{"samples": batch[:2]}, {"samples": batch[2:5]}, {"samples": batch[5:]}], entries)
    _, whole = _prepare("flux", latent, entries)
    assert torch.equal(listed.cache["latents"], whole.cache["latents"])


def test_video_latents_and_single_frame_families():
    wan, qwen = build_preset("wan"), build_preset("qwenimage")
    text = [[torch.randn(1, 5, 32), {}]]
    video = {"samples": torch.randn(2, 16, 3, 4, 4)}
    prepared = prepare_comfy_data(wan.family, wan.family.text(wan.transformer.config), video, text)
    assert prepared.cache["latents"].shape == (2, 16, 3, 4, 4)  # one sample = one clip of 3 latent frames
    image = {"samples": torch.randn(2, 16, 4, 4)}
    assert prepare_comfy_data(wan.family, wan.family.text(wan.transformer.config), image,
                              text).cache["latents"].shape == (2, 16, 1, 4, 4)
    with pytest.raises(ComfyDataError, match="3 latent frames but family 'qwenimage' trains on images"):
        prepare_comfy_data(qwen.family, qwen.family.text(qwen.transformer.config), video, text)
    flux = build_preset("flux")
    with pytest.raises(ComfyDataError, match="3 latent frames but family 'flux'"):
        prepare_comfy_data(flux.family, flux.family.text(flux.transformer.config), video, text)


@pytest.mark.parametrize("change, message", [
    (lambda lat, cond: ({"samples": lat["samples"][:, :4]}, cond),
     "latent has 4 channels but family 'flux' takes 16 (ComfyUI latent format Flux)"),
    (lambda lat, cond: (lat, [[c[..., :16], e] for c, e in cond]),
     "conditioning entry 0 has width 16 but the flux model's text width is 32"),
    (lambda lat, cond: (lat, cond[:4]), "6 latents but 4 conditioning entries"),
    (lambda lat, cond: (lat, [[c, {}] for c, _ in cond]), "conditioning entry 0 has pooled_output none"),
    (lambda lat, cond: ([lat, {"samples": lat["samples"][..., :2, :2]}], cond), "latent 1 has shape (16, 2, 2)"),
    (lambda lat, cond: (lat, [[c.expand(2, -1, -1), e] for c, e in cond]), "allowed (1, L, D)"),
    (lambda lat, cond: ({"samples": lat["samples"] * float("nan")}, cond), "NaN"),
    (lambda lat, cond: (lat, []), "conditioning is empty"),
])
def test_data_that_cannot_train_the_model_is_named(change, message, image_runs):
    _, cache, _ = image_runs("flux")
    latent, conditioning = change(*_as_comfy("flux", cache))
    with pytest.raises(ComfyDataError) as info:
        _prepare("flux", latent, conditioning)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_family_without_a_comfyui_latent_mapping_says_so():
    pixart = build_preset("pixart")
    with pytest.raises(ComfyDataError, match="family 'pixart' has no ComfyUI latent mapping") as info:
        prepare_comfy_data(pixart.family, pixart.family.text(pixart.transformer.config),
                           {"samples": torch.zeros(1, 4, 4, 4)}, [[torch.zeros(1, 3, 32), {}]])
    assert "flux" in str(info.value) and "Image+Caption Dataset" in str(info.value)
    assert {"flux", "sd3", "wan", "qwenimage", "chroma", "lumina2", "hunyuanvideo", "auraflow", "ltxvideo",
            "wanvace"} == set(comfy_mapped_families())


def test_latent_formats_equal_the_engines_vae_normalisation():
    """ComfyUI's process_in and the image path's normalisation (encode_latents, from the VAE config)
    agree for the released configs: Flux's scaling/shift, and the Wan VAE's per-channel mean/std
    (diffusers' AutoencoderKLWan defaults)."""
    z = torch.randn(2, 16, 1, 4, 4)

    class FakeVae(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = FrozenDict(config)

        def encode(self, x):
            return type("Out", (), {"latent": z if x.ndim == 5 else z[:, :, 0]})()

    flux = FakeVae(scaling_factor=0.3611, shift_factor=0.1159)
    assert torch.allclose(encode_latents(flux, torch.zeros(2, 3, 8, 8), False), FLUX.process_in(z[:, :, 0]))
    defaults = inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters
    mean, std = defaults["latents_mean"].default, defaults["latents_std"].default
    assert tuple(mean) == WAN21.mean and tuple(std) == WAN21.std
    wan = FakeVae(z_dim=16, latents_mean=mean, latents_std=std)
    assert torch.allclose(encode_latents(wan, torch.zeros(2, 3, 8, 8), True), WAN21.process_in(z), atol=1e-6)
    assert torch.allclose(WAN21.process_out(WAN21.process_in(z)), z, atol=1e-6)


def test_resume_with_prepared_data_equals_an_uninterrupted_run(image_runs, tmp_path):
    _, cache, _ = image_runs("flux")
    latent, conditioning = _as_comfy("flux", cache)
    full = train(_config(tmp_path, "full", steps=5), prepared=_prepare("flux", latent, conditioning)[1],
                 bundle=build_preset("flux"), **QUIET)
    stops = iter(range(1, 100))
    first = train(_config(tmp_path, "split", steps=5), prepared=_prepare("flux", latent, conditioning)[1],
                  bundle=build_preset("flux"), should_stop=lambda: next(stops) == 2, **QUIET)
    assert first.interrupted and len(first.history) == 2
    second = train(_config(tmp_path, "split", steps=5, resume=True),
                   prepared=_prepare("flux", latent, conditioning)[1], bundle=build_preset("flux"), **QUIET)
    assert [h["loss"] for h in second.history] == pytest.approx([h["loss"] for h in full.history], abs=1e-6)


def test_prepared_data_and_a_data_folder_are_one_source_too(image_runs, tmp_path):
    _, cache, root = image_runs("flux")
    _, prepared = _prepare("flux", *_as_comfy("flux", cache))
    with pytest.raises(ValueError, match="with prepared data: allowed unset"):
        TrainingRun(_config(tmp_path, "x", data=str(root)), prepared=prepared)


# ---- the node ------------------------------------------------------------------------------


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    return tmp_path


def _schedule(family):
    return NODES["SegCkptSchedule"].execute(
        family=family, gradient_checkpointing=True, gradient_checkpointing_backend="torch",
        gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=0,
        gradient_checkpointing_offload_attention=False, gradient_checkpointing_offload_pin_memory_max_buckets=0)[0]


def test_train_lora_node_takes_latent_and_conditioning(base, image_runs):
    _, cache, _ = image_runs("flux")
    latent, conditioning = _as_comfy("flux", cache)
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0)
    with torch.inference_mode():  # as ComfyUI runs nodes
        (run,) = run_node(NODES["SegCkptTrainLoRA"], model, schedule=_schedule("flux"), steps=2, run_name="comfy",
                          latent=latent, conditioning=conditioning[:1])
    report = run.report
    assert report["dataset"]["source"] == "ComfyUI LATENT + CONDITIONING" and report["config"]["data"] is None
    assert report["dataset"]["conditioning"] == "one for all images" and len(run.history) == 2


def test_train_lora_node_refuses_a_family_without_mapping_before_any_work(base):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("pixart", "(tiny preset)", 0)
    with pytest.raises(ValueError, match="family 'pixart' has no ComfyUI latent mapping"):
        run_node(NODES["SegCkptTrainLoRA"], model, schedule=_schedule("pixart"), steps=1, run_name="px",
                 latent={"samples": torch.zeros(1, 4, 4, 4)}, conditioning=[[torch.zeros(1, 3, 32), {}]])
    assert not (base / "output" / "segckpt" / "px").exists()


@pytest.mark.parametrize("linked, message", [
    ({"dataset": None}, True),
    ({"latent": None, "conditioning": None}, True),
    ({}, "Train LoRA has no data: connect dataset"),
    ({"dataset": None, "latent": None, "conditioning": None}, "one data source"),
    ({"latent": None}, "latent is connected without conditioning"),
    ({"conditioning": None}, "conditioning is connected without latent"),
])
def test_train_lora_validation_sees_which_data_inputs_are_connected(base, linked, message):
    """ComfyUI passes None for a linked input that VALIDATE_INPUTS names and leaves unconnected
    optional inputs out."""
    found = verdict(NODES["SegCkptTrainLoRA"], run_name="r", **linked)
    assert found is True if message is True else message in found


def test_segckpt_run_validates_the_data_inputs_like_comfyui(base):
    graph = load_api_graph(WORKFLOW)
    train_node = next(k for k, v in graph.items() if v["class_type"] == "SegCkptTrainLoRA")
    graph[train_node]["inputs"].pop("dataset")
    with pytest.raises(GraphError, match=f"node {train_node} \\(SegCkptTrainLoRA\\): Train LoRA has no data"):
        run_graph(graph)
    assert "dataset" in NODES["SegCkptTrainLoRA"].INPUT_TYPES()["optional"]


# ---- the CLI's text encoders ---------------------------------------------------------------


def test_cli_says_loudly_when_it_falls_back_to_the_stand_in(tmp_path):
    out = tmp_path / "out"
    with pytest.warns(TextEncoderWarning, match="captions are NOT encoded by a language model") as caught:
        assert cli.main(["train", "--steps", "1", "--resolution", "32", "--output", str(out)]) == 0
    notice = next(w for w in caught if issubclass(w.category, TextEncoderWarning))
    line = warnings.formatwarning(notice.message, notice.category, notice.filename, notice.lineno)
    assert line.startswith("segckpt: warning: captions are NOT encoded by a language model")  # one stderr line
    assert "--text-encoder <CLIP folder> <T5 folder>" in line and line.count("\n") == 1
    report = json.loads((out / "report.json").read_text())
    assert report["text_encoder"]["kind"] == "stand-in" and "NOT encoded" in report["text_encoder"]["warning"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {"clip": save_tiny_text_encoder(root / "clip_l", "clip"),
            "t5": save_tiny_text_encoder(root / "t5", "t5"),
            "clip_l": save_tiny_text_encoder(root / "sd3_clip_l", "clip", width=8, projection=16),
            "clip_g": save_tiny_text_encoder(root / "sd3_clip_g", "clip", width=12, projection=16, seed=1)}


def test_cli_trains_with_the_familys_text_encoders(tmp_path, encoders):
    out = tmp_path / "out"
    argv = ["train", "--steps", "1", "--resolution", "32", "--output", str(out),
            "--text-encoder", str(encoders["t5"]), str(encoders["clip"])]  # any order: identified by config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(argv) == 0
    assert not [w for w in caught if issubclass(w.category, TextEncoderWarning)]
    report = json.loads((out / "report.json").read_text())
    assert [e["kind"] for e in report["text_encoder"]["encoders"]] == ["clip", "t5"]
    assert report["config"]["text_encoder_path"] == [str(encoders["t5"]), str(encoders["clip"])]


def test_a_missing_encoder_of_the_family_is_named(tmp_path, capsys, encoders):
    argv = ["train", "--steps", "1", "--output", str(tmp_path / "o"), "--text-encoder", str(encoders["t5"])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "family 'flux' needs the text encoders <CLIP folder> <T5 folder>; given: t5" in err


def test_sd3_text_encoders_form_the_pipelines_layout(encoders):
    """SD3: CLIP-L and CLIP-G penultimate states side by side, zero-padded to the T5 width, before
    the T5 tokens; pooled = the two projected CLIP embeddings concatenated."""
    sd3 = get_family("sd3")
    spec = sd3.text(build_preset("sd3").transformer.config)
    encode = load_text_encoders([encoders["clip_l"], encoders["clip_g"], encoders["t5"]], sd3, spec)
    text = encode(["a photo of a cat", "a dog"])
    assert text.seq.shape == (2, 77 + 256, 32) and text.pooled.shape == (2, 32) and text.mask.all()
    assert text.seq[:, :77, 8 + 12:].abs().max() == 0 and text.seq[:, :77, :20].abs().max() > 0
    with pytest.raises(TextEncoderError, match="needs the text encoders <CLIP folder> <CLIP folder> <T5 folder>"):
        load_text_encoders([encoders["clip_l"], encoders["t5"]], sd3, spec)


def test_encoder_folders_are_identified_by_their_config(tmp_path, encoders):
    assert encoder_kind(encoders["clip"]) == "clip" and encoder_kind(encoders["t5"]) == "t5"
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert encoder_kind(qwen) == "qwen2_5_vl"
    family = get_family("qwenimage")
    with pytest.raises(TextEncoderError, match="needs the text encoders <Qwen2.5-VL folder>; given: t5"):
        load_text_encoders([encoders["t5"]], family, family.text(build_preset("qwenimage").transformer.config))
    with pytest.raises(TextEncoderError, match="no readable config.json"):
        encoder_kind(tmp_path)
    broken = save_tiny_text_encoder(tmp_path / "no_weights", "t5")
    (broken / "model.safetensors").unlink()  # e.g. pickle weights only: never loaded
    with pytest.raises(TextEncoderError, match="no_weights' could not be loaded \\(t5\\)"):
        load_text_encoders([broken], get_family("wan"), TextSpec(32))


def test_text_encoder_option_accepts_one_or_several_folders(tmp_path):
    assert TrainConfig.create(text_encoder_path="a").model.text_encoder_path == ("a",)
    assert TrainConfig.create(text_encoder_path=["a", "b"]).model.text_encoder_path == ("a", "b")
    assert TrainConfig().replace(text_encoder_path=None).model.text_encoder_path is None
    args = cli._parser().parse_args(["train", "--text-encoder", "x", "y"])
    assert cli.config_from_args(args).model.text_encoder_path == ("x", "y")
    with pytest.raises(ValueError, match="text_encoder_path=3 is invalid"):
        TrainConfig.create(text_encoder_path=3)


class _RecordingVAE:
    """ComfyUI's VAE interface for previews: ``decode`` takes raw latents ``(B, C, h, w)`` and gives
    images ``(B, 8h, 8w, 3)`` in [0, 1]."""

    def __init__(self):
        self.seen = []

    def decode(self, latents):
        self.seen.append(latents)
        gray = torch.sigmoid(latents.mean(dim=1, keepdim=True))
        return torch.nn.functional.interpolate(gray, scale_factor=8).movedim(1, -1).expand(-1, -1, -1, 3)


def test_train_lora_node_previews_decode_with_comfyuis_vae_and_reach_the_page(base, image_runs, monkeypatch):
    from segmented_checkpointing.nodes import training_nodes
    from segmented_checkpointing.nodes.environment import local_host

    events = []
    host = dataclasses.replace(local_host(base), send=lambda event, data: events.append((event, data)))
    monkeypatch.setattr(training_nodes, "current_host", lambda: host)
    _, cache, _ = image_runs("flux")
    latent, conditioning = _as_comfy("flux", cache)
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0)
    vae = _RecordingVAE()
    with torch.inference_mode():
        run_node(NODES["SegCkptTrainLoRA"], model, schedule=_schedule("flux"), steps=3, run_name="seen",
                 latent=latent, conditioning=conditioning, vae=vae, preview_every=2, node_id="7")
    previews = [data for event, data in events if event == "segckpt.preview"]
    assert [p["step"] for p in previews] == [2, 3] and all(p["node"] == "7" for p in previews)
    assert previews[0]["images"] == [{"filename": "step_00002_conditioning0.png",
                                      "subfolder": "segckpt/seen_00001/previews", "type": "output"}]
    assert (base / "output" / "segckpt" / "seen_00001" / "previews" / "step_00003_conditioning0.png").is_file()
    # ComfyUI's VAE decoded one latent per preview round, of the training latents' shape
    assert len(vae.seen) == 2 and vae.seen[0].shape == (1, *cache["latents"].shape[1:])
    assert [event for event, _ in events].count("segckpt.loss") == 3
