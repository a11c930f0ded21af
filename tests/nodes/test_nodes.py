"""The node pack without ComfyUI: node functions, validation, path containment, `segckpt run`."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from helpers import pack_only, verdict
from PIL import Image
from safetensors.torch import load_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.model.bundle import ModelBundle
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.graph import GraphError, load_api_graph, run_graph, run_node
from segmented_checkpointing.nodes.payloads import ModelSource
from segmented_checkpointing.nodes.v3 import overridden

WORKFLOWS = sorted((Path(__file__).resolve().parents[2] / "workflows" / "api").glob("*.api.json"))


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    (tmp_path / "input" / "photos").mkdir(parents=True)
    return tmp_path


def _instances(cls: type) -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is cls]


def test_every_node_has_category_tooltips_and_function():
    for name, cls in NODES.items():
        assert cls.GET_SCHEMA().category == "training/gradient checkpointing", name
        assert overridden(cls, "execute") is not None
        for section in ("required", "optional"):
            for key, spec in cls.INPUT_TYPES().get(section, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{key} has no tooltip"


def test_node_functions_return_the_declared_types(base):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0)
    assert isinstance(model, ModelSource) and model.family.name == "flux"
    with torch.inference_mode():  # as ComfyUI runs nodes
        loaded = model.load()
    assert isinstance(loaded, ModelBundle) and not any(p.is_inference() for p in loaded.transformer.parameters())
    transformer_class = type(loaded.transformer)
    del loaded
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("(built-in sample photos)", 64)
    (schedule,) = NODES["SegCkptSchedule"].execute(
        family="flux", gradient_checkpointing=True, gradient_checkpointing_backend="torch", gradient_checkpointing_interval=2,
        gradient_checkpointing_segment_stride=0, gradient_checkpointing_offload_attention=False,
        gradient_checkpointing_offload_pin_memory_max_buckets=12)
    assert schedule.family == "flux" and isinstance(schedule.schedule, CheckpointSchedule)
    assert schedule.schedule.gradient_checkpointing_segment_stride is None
    (lora,) = NODES["SegCkptLoRAConfig"].execute(4, 4.0, 0.0, "to_q, to_v")
    assert isinstance(lora, LoraSettings) and lora.target_modules == ("to_q", "to_v")
    transformers = len(_instances(transformer_class))
    with torch.inference_mode():  # as ComfyUI runs nodes
        (run,) = run_node(NODES["SegCkptTrainLoRA"], model, schedule, dataset=dataset, steps=2, learning_rate=1e-3,
                          lr_scheduler="constant", batch_size=1, gradient_accumulation_steps=1,
                          seed=0, run_name="nodes_test", resume=False, lora_config=lora,
                          node_id="5")
    # ComfyUI caches every node's output: none holds a model after the run (issue 34)
    assert run.model is None and len(_instances(transformer_class)) == transformers
    shown = NODES["SegCkptLossGraph"].execute(run)
    (image,) = shown.result
    assert shown.ui["images"][0]["subfolder"] == "segckpt/nodes_test_00001"  # numbered: one folder a queue
    assert (base / "output" / "segckpt" / "nodes_test_00001" / "loss.png").is_file()
    assert image.ndim == 4 and image.shape[0] == 1 and image.shape[-1] == 3 and 0 <= image.min() <= image.max() <= 1
    assert image.shape[1:3] == (720, 640)  # the loss curve and beneath it the loss by noise level
    report = NODES["SegCkptRunReport"].execute(run)
    assert isinstance(report.result[0], str) and "CC" in report.result[0]
    saved = NODES["SegCkptSaveLoRA"].execute(run, "node_lora")
    assert saved.ui["text"][0].startswith("saved models/loras/node_lora_00001.safetensors (comfyui; 2 steps")
    assert saved.result == ("node_lora_00001.safetensors",)  # links into LoraLoaderModelOnly.lora_name
    tensors = load_file(base / "models" / "loras" / "node_lora_00001.safetensors")
    assert tensors and all(k.startswith("diffusion_model.") for k in tensors)  # what ComfyUI maps for the family
    again = NODES["SegCkptSaveLoRA"].execute(run, "node_lora", "both")  # never over the first; both files
    assert again.result == ("node_lora_00002.safetensors",)
    assert "diffusers: node_lora_00002_diffusers.safetensors" in again.ui["text"][0]
    twin = load_file(base / "models" / "loras" / "node_lora_00002_diffusers.safetensors")
    assert twin and all(k.startswith("transformer.") for k in twin)
    diffusers = NODES["SegCkptSaveLoRA"].execute(run, "node_lora", "diffusers")
    saved = load_file(base / "models" / "loras" / diffusers.result[0])
    trained = load_file(base / "output" / "segckpt" / "nodes_test_00001" / "lora.safetensors")  # from the model
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)


@pytest.mark.parametrize("cls, inputs, text", [
    ("SegCkptImageCaptionDataset", {"folder": "/etc"}, "folder='/etc'"),
    ("SegCkptImageCaptionDataset", {"folder": "../x"}, "folder='../x'"),
    ("SegCkptImageCaptionDataset", {"folder": "missing"}, "no such folder"),
    ("SegCkptSaveLoRA", {"filename_prefix": "../../x"}, "filename_prefix='../../x'"),
    ("SegCkptTrainLoRA", {"run_name": "../../x"}, "run_name"),
    ("SegCkptLoadDiffusionModel", {"source": "../outside"}, "source='../outside'"),
])
def test_paths_are_contained(base, cls, inputs, text):
    found = verdict(NODES[cls], **inputs)
    assert found is not True and text in found


def test_links_out_of_the_input_folder_are_refused(base, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (base / "input" / "sneaky").symlink_to(outside)
    assert "outside" in verdict(NODES["SegCkptImageCaptionDataset"], folder="sneaky")
    Image.new("RGB", (32, 32)).save(base / "input" / "photos" / "a.png")
    assert NODES["SegCkptImageCaptionDataset"].validate_inputs(folder="photos") is True


def test_a_dataset_that_cannot_train_is_refused_when_queued(base):
    """The engine's data check (captions decoded, images read through) runs at /prompt."""
    photos = base / "input" / "photos"
    Image.new("RGB", (32, 32)).save(photos / "a.png")
    (photos / "b.png").write_text("a text file named b.png")
    assert verdict(NODES["SegCkptImageCaptionDataset"], folder="photos") == (
        "image 'input/photos/b.png' could not be read: cannot identify image file 'input/photos/b.png'")


def _graph(name="train_segmented_lora.api.json"):
    return load_api_graph(Path(__file__).resolve().parents[2] / "workflows" / "api" / name)


@pytest.mark.parametrize("mutate, message", [
    (lambda g: g["5"]["inputs"].pop("steps"), "node 5 (SegCkptTrainLoRA): required input steps is missing"),
    (lambda g: g["3"]["inputs"].update(gradient_checkpointing_interval="two"), "gradient_checkpointing_interval='two'"),
    (lambda g: g["3"]["inputs"].update(gradient_checkpointing_segment_stride=1), "gradient_checkpointing_segment_stride=1"),
    (lambda g: g["1"].update(class_type="KSampler"), "node 1 'KSampler': not nodes of this pack"),
    (lambda g: g["2"]["inputs"].update(folder="/etc"), "node 2 (SegCkptImageCaptionDataset): folder='/etc'"),
    (lambda g: g["6"]["inputs"].update(filename_prefix="../../x"), "filename_prefix='../../x'"),
])
def test_invalid_graphs_fail_before_any_node_runs(base, mutate, message):
    graph = _graph()
    mutate(graph)
    with pytest.raises(GraphError) as info:
        run_graph(graph)
    assert message in str(info.value)
    assert not (base / "output").exists()


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_every_api_workflow_runs_through_segckpt_run(tmp_path, workflow, capsys):
    graph = load_api_graph(workflow)
    if not pack_only(workflow):  # the closed loop: ComfyUI's own loaders, encoders and sampler
        assert cli.main(["run", str(workflow), "--base-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "node 1 'UNETLoader'" in err and "queue a workflow that uses ComfyUI's own nodes" in err
        assert not (tmp_path / "output").exists()
        return
    for node in graph.values():  # keep CI short: fewer steps, smaller images; same graph otherwise
        if node["class_type"] == "SegCkptTrainLoRA":
            node["inputs"]["steps"] = 3
        if node["class_type"] == "SegCkptImageCaptionDataset":
            node["inputs"]["resolution"] = 64
        if node["class_type"] in ("SegCkptSweep", "SegCkptSchedulePlanner"):
            node["inputs"]["measured_steps"] = 1
    short = tmp_path / workflow.name
    short.write_text(json.dumps(graph))
    assert cli.main(["run", str(short), "--base-dir", str(tmp_path)]) == 0
    types = {node["class_type"] for node in graph.values()}
    out = capsys.readouterr().out
    if "SegCkptSaveLoRA" in types:
        loras = list((tmp_path / "models" / "loras").glob("*.safetensors"))
        assert len(loras) == 1 and load_file(loras[0])
        family = next(n["inputs"]["family"] for n in graph.values() if n["class_type"] == "SegCkptLoadDiffusionModel")
        assert f"plan ({family}" in out
    if "SegCkptSweep" in types:
        assert {p.name for p in (tmp_path / "output" / "segckpt" / "sweep_00001").iterdir()} >= {
            "sweep.md", "sweep.csv", "sweep.json", "sweep.png"}
    if "SegCkptSchedulePlanner" in types:
        assert json.loads((tmp_path / "output" / "segckpt" / "plan_00001" / "schedule.json").read_text())


def test_segckpt_run_refuses_unknown_node_types(tmp_path, capsys):
    path = tmp_path / "bad.api.json"
    path.write_text(json.dumps({"1": {"class_type": "CheckpointLoaderSimple", "inputs": {}}}))
    assert cli.main(["run", str(path), "--base-dir", str(tmp_path)]) == 2
    assert "CheckpointLoaderSimple" in capsys.readouterr().err


def test_schedule_node_refuses_a_backend_the_family_cannot_run():
    schedule = NODES["SegCkptSchedule"]
    ok = dict(gradient_checkpointing_backend="torch-ffn", gradient_checkpointing_interval=2,
              gradient_checkpointing_segment_stride=4, gradient_checkpointing_offload_attention=False)
    assert schedule.validate_inputs(family="flux", **ok) is True
    found = verdict(schedule, family="ideogram4", **ok)  # no FFN boundary (docs/SCHEDULES.md)
    assert "gradient_checkpointing_backend='torch-ffn'" in found and "ideogram4" in found
    found = verdict(schedule, family="ideogram4", **{**ok, "gradient_checkpointing_backend": "torch",
                                                            "gradient_checkpointing_offload_attention": True})
    assert "gradient_checkpointing_offload_attention=True" in found


def test_train_refuses_a_schedule_of_another_family_before_any_work(base):
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0)
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("(built-in sample photos)", 64)
    keys = dict(gradient_checkpointing=True, gradient_checkpointing_backend="torch", gradient_checkpointing_interval=2,
                gradient_checkpointing_segment_stride=0, gradient_checkpointing_offload_attention=False,
                gradient_checkpointing_offload_pin_memory_max_buckets=0)
    (wan_schedule,) = NODES["SegCkptSchedule"].execute(family="wan", **keys)
    with pytest.raises(ValueError, match="schedule is for family 'wan' but the model is 'flux'"):
        run_node(NODES["SegCkptTrainLoRA"], model, wan_schedule, dataset=dataset, steps=1, learning_rate=1e-3,
                 lr_scheduler="constant", batch_size=1, gradient_accumulation_steps=1, seed=0,
                 run_name="x", resume=False)
    assert not (base / "output" / "segckpt" / "x").exists()


def test_precision_and_kernels_reach_the_run_through_the_nodes(base):
    pytest.importorskip("torchao")
    (model,) = NODES["SegCkptLoadDiffusionModel"].execute("flux", "(tiny preset)", 0, "int8-torchao")
    assert model.base_precision == "int8-torchao"
    (dataset,) = NODES["SegCkptImageCaptionDataset"].execute("(built-in sample photos)", 64)
    (schedule,) = NODES["SegCkptSchedule"].execute(
        family="flux", gradient_checkpointing=True, gradient_checkpointing_backend="unsloth",
        gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
        gradient_checkpointing_offload_attention=False, gradient_checkpointing_offload_pin_memory_max_buckets=12)
    with torch.inference_mode():
        (run,) = run_node(NODES["SegCkptTrainLoRA"], model, schedule, dataset=dataset, steps=2, learning_rate=1e-3,
                          lr_scheduler="constant", batch_size=1, gradient_accumulation_steps=1,
                          seed=0, run_name="prec", resume=False, attention_backend="flash,math",
                          on_nonfinite="skip")
    report = run.report
    assert report["precision"]["base_model_precision"] == "int8-torchao"
    assert report["precision"]["quantized_linear_layers"] == report["precision"]["linear_layers"] > 0
    assert report["attention_backend"] == ["flash", "math"] and report["config"]["on_nonfinite"] == "skip"
    assert "attention_backend='sage'" in verdict(NODES["SegCkptTrainLoRA"], run_name="run", attention_backend="sage")


def test_two_graphs_queued_into_one_run_name_get_two_folders(tmp_path):
    """The number is claimed by creating the folder, so a second claimant (another graph, or
    another server sharing the output folder) takes the next one instead of the same folder."""
    from segmented_checkpointing.nodes.environment import numbered_run

    first, second = numbered_run(tmp_path, "lora_run"), numbered_run(tmp_path, "lora_run")
    assert (first.name, second.name) == ("lora_run_00001", "lora_run_00002")
    assert first.is_dir() and second.is_dir()


def test_the_noise_schedule_node_reaches_the_run_config_and_refuses_by_name(base):
    from segmented_checkpointing.nodes.training_nodes import run_config

    node = NODES["SegCkptNoiseSchedule"]
    values = {key: spec[1]["default"] for key, spec in node.INPUT_TYPES()["required"].items()}
    (objective,) = node.execute(**{**values, "timestep_sampling": "mode", "flow_shift": "3", "guidance_value": 3.5})
    assert (objective.timestep_sampling, objective.shift, objective.guidance_value) == ("mode", 3.0, 3.5)
    config = run_config({"run_name": "run", "noise_schedule": objective}, find_run=False)
    assert config.objective == objective and config.to_dict()["flow_shift"] == "3.0"
    assert "flow_shift='three' is invalid: allowed auto" in verdict(node, **{**values, "flow_shift": "three"})
    sd3 = ModelSource(config.replace(family="sd3", guidance_value=1.0))  # guidance 3.5 on sd3: refused, one line
    with pytest.raises(ValueError, match="guidance_value=3.5 is invalid for family 'sd3'"):
        run_config({"run_name": "run", "noise_schedule": objective}, sd3, find_run=False)


def test_optimizer_clipping_and_caption_dropout_widgets_reach_the_run_config_and_refuse_by_name(base, monkeypatch):
    """Train LoRA's optimizer and max_grad_norm and the dataset node's caption_dropout: appended
    after each node's earlier widgets (a saved workflow's widgets_values map by position), in the
    run's config, a bad value refused by the input's name when queued, before the model loads."""
    from segmented_checkpointing.engine.config import optim
    from segmented_checkpointing.nodes.training_nodes import run_config

    train, data = NODES["SegCkptTrainLoRA"], NODES["SegCkptImageCaptionDataset"]
    assert list(train.INPUT_TYPES()["optional"])[-2:] == ["optimizer", "max_grad_norm"]
    assert list(data.INPUT_TYPES()["optional"])[-1] == "caption_dropout"
    (dataset,) = data.execute("(built-in sample photos)", 64, caption_dropout=0.25)
    config = run_config({"run_name": "run", "optimizer": "adafactor", "max_grad_norm": 0.5, "dataset": dataset},
                        find_run=False)
    assert (config.optimizer.name, config.optimizer.max_grad_norm, config.data.caption_dropout) == ("adafactor", 0.5,
                                                                                                   0.25)
    assert verdict(train, run_name="run", optimizer="sgd") == (
        "optimizer='sgd' is invalid: allowed adamw, adamw8bit, adafactor, prodigy.")
    assert verdict(train, run_name="run", max_grad_norm=-1.0) == (
        "max_grad_norm=-1.0 is invalid: allowed a finite number > 0 and <= 1e+06, or 0 (off).")
    assert verdict(data, folder="(built-in sample photos)", caption_dropout=1.5) == (
        "caption_dropout=1.5 is invalid: allowed a finite number from 0 to 1.")
    found = optim.importlib.util.find_spec
    monkeypatch.setattr(optim.importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else found(name, *a))
    assert verdict(train, run_name="run", optimizer="prodigy").startswith(
        "optimizer='prodigy' needs prodigyopt (pip install prodigyopt), which is not installed here")
