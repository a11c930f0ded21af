"""The pack inside a real ComfyUI server (skipped unless ``COMFYUI_PATH`` is set; see live_comfyui.py)."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from comfy_models import CLOSED_LOOP_FILES, TEXT_ENCODER, TRANSFORMER, tiny_sd3_transformer, write_closed_loop_files
from live_comfyui import (
    NODE_TYPES,
    PACK_FOLDER,
    ROOT,
    Server,
    Socket,
    api_workflow,
    comfyui_path,
    finished,
    node_id_of,
    queue,
)
from original_layouts import sd3_to_mmdit
from safetensors.torch import load_file

from segmented_checkpointing.engine.train.state import STATE_FILE, read_state_header

WORKFLOWS = tuple(sorted(p.name for p in (ROOT / "workflows" / "api").glob("*.api.json")))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkout = comfyui_path()
    base = tmp_path_factory.mktemp("comfyui-base")
    write_closed_loop_files(base)  # the closed-loop workflows' model files and images
    subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(ROOT / "tests" / "live" / "comfy_write_wan_vae.py"),
                    str(checkout), str(base / "models" / "vae" / CLOSED_LOOP_FILES["wan"][1])], check=True)
    running = Server(checkout, base)
    yield running
    running.stop()


@pytest.fixture
def ws(server):
    socket_ = Socket(server)
    yield socket_
    socket_.close()


def _short(graph: dict, steps: int = 4) -> dict:
    """The same graph with fewer steps and smaller images (keeps the live suite to minutes)."""
    graph = copy.deepcopy(graph)
    for node in graph.values():
        inputs = node["inputs"]
        if node["class_type"] == "DualCLIPLoader" or inputs.get("type") == "wan":
            # CLIP-L alone through CLIPLoader(type=sd3) stands in for T5-XXL / UMT5-XXL (4.7B and 5.7B
            # parameters) on a CPU runner (tests/comfy_models.py CLOSED_LOOP_FLUX)
            node.update(class_type="CLIPLoader", inputs={"clip_name": TEXT_ENCODER, "type": "sd3", "device": "default"})
        if node["class_type"] == "SegCkptTrainLoRA":
            inputs["steps"] = steps
        if node["class_type"] == "SegCkptImageCaptionDataset":
            inputs["resolution"] = 64
        if "measured_steps" in inputs:
            inputs["measured_steps"] = 1
        if node["class_type"] in ("ImageScale", "EmptySD3LatentImage", "EmptyHunyuanLatentVideo"):
            inputs.update(width=64, height=64)
        if node["class_type"] == "KSampler":
            inputs["steps"] = 2
        if inputs.get("preview_every"):
            inputs["preview_every"] = 2
        if "run_name" in inputs:  # a new run folder (no overwrite refusal)
            inputs["run_name"] = f"{inputs['run_name']}_{uuid.uuid4().hex[:8]}"
    return graph


def _our_traceback(log: str) -> bool:
    """Whether a traceback in ComfyUI's log passes through this pack (core ComfyUI logs import
    failures of its own optional nodes on some installs: those are not ours to judge)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return any(PACK_FOLDER in block.split("\n\n")[0] or "segmented_checkpointing" in block.split("\n\n")[0]
               for block in blocks)


def _completed(server, ws, graph: dict) -> tuple[str, dict]:
    """Queue ``graph``, wait for its end, check that it succeeded: ``(prompt_id, its history)``."""
    status, body = queue(server, ws, graph)
    assert status == 200, body
    prompt_id = body["prompt_id"]
    end = ws.wait_for(finished(prompt_id))
    assert end["type"] != "execution_error", (end["data"].get("node_type"), end["data"].get("exception_message"))
    history = server.get(f"/history/{prompt_id}")[prompt_id]
    assert history["status"]["status_str"] == "success", history["status"]
    return prompt_id, history


def test_pack_loads_and_lists_every_node(server):
    log = server.log()
    ours = [line for line in log.splitlines() if PACK_FOLDER in line]
    assert any("seconds" in line and "IMPORT FAILED" not in line for line in ours), log[-3000:]
    assert not any("IMPORT FAILED" in line for line in ours) and not _our_traceback(log), log[-3000:]
    info = server.get("/object_info")
    assert set(NODE_TYPES) <= set(info)
    assert all(info[name]["category"] == "training/gradient checkpointing" for name in NODE_TYPES)


def test_templates_menu_lists_the_ui_workflows(server):
    ui_names = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    assert sorted(server.get("/workflow_templates")[PACK_FOLDER]) == ui_names
    first = server.get(f"/api/workflow_templates/{PACK_FOLDER}/{ui_names[0]}.json")
    assert "nodes" in first and "links" in first


@pytest.mark.parametrize("name", WORKFLOWS)
def test_api_workflow_completes_with_one_progress_event_per_step(server, ws, name):
    """Every API workflow completes; a training one sends exactly `steps` progress events."""
    graph = _short(api_workflow(name))
    prompt_id, history = _completed(server, ws, graph)
    if not any(node["class_type"] == "SegCkptTrainLoRA" for node in graph.values()):
        sweep = node_id_of(graph, "SegCkptSweep")
        assert history["outputs"][sweep]["images"][0]["filename"] == "sweep.png"
        return
    train = node_id_of(graph, "SegCkptTrainLoRA")
    steps = graph[train]["inputs"]["steps"]
    progress = [(m["data"]["value"], m["data"]["max"]) for m in ws.messages
                if m["type"] == "progress" and m["data"].get("node") == train and m["data"].get("prompt_id") == prompt_id]
    before = []
    if any(node["class_type"] == "SegCkptFitGuardrails" for node in graph.values()):
        # the pre-flight before step 1: encoding the data, then its K probe steps on the same bar
        probes = progress[1][1]
        before = [(0, 1), (0, probes)] + [(k, probes) for k in range(1, probes + 1)]
        notes = [m["data"]["lines"][-1] for m in ws.messages if m["type"] == "segckpt.notes"
                 and m["data"]["node"] == train and m["data"]["lines"][-1].startswith("pre-flight: probe step")]
        assert notes[-1].startswith(f"pre-flight: probe step {probes}/{probes}") and probes >= 3, notes
    assert progress == before + [(k, steps) for k in range(1, steps + 1)]
    losses = [m["data"] for m in ws.messages if m["type"] == "segckpt.loss" and m["data"]["node"] == train]
    assert [m["step"] for m in losses][-steps:] == list(range(1, steps + 1))
    save = node_id_of(graph, "SegCkptSaveLoRA")
    shown = history["outputs"][save]["text"][0]
    assert shown.startswith("saved models/loras/") and ".safetensors" in shown and str(server.base) not in shown


def _errors(body: dict, node_id: str) -> str:
    return " ".join(f"{e.get('message')} {e.get('details')}" for e in body["node_errors"][node_id]["errors"])


@pytest.mark.parametrize("mutate, node_class, text", [
    (lambda g, n: g[n["SegCkptTrainLoRA"]]["inputs"].pop("steps"), "SegCkptTrainLoRA", "steps"),
    (lambda g, n: g[n["SegCkptSchedule"]]["inputs"].update(gradient_checkpointing_interval="two"),
     "SegCkptSchedule", "gradient_checkpointing_interval"),
    (lambda g, n: g[n["SegCkptSchedule"]]["inputs"].update(gradient_checkpointing_interval=2,
                                                             gradient_checkpointing_segment_stride=1),
     "SegCkptSchedule", "gradient_checkpointing_segment_stride=1"),
    (lambda g, n: g[n["SegCkptSaveLoRA"]]["inputs"].update(filename_prefix="../../x"),
     "SegCkptSaveLoRA", "filename_prefix='../../x'"),
    (lambda g, n: g[n["SegCkptImageCaptionDataset"]]["inputs"].update(folder="/etc"),
     "SegCkptImageCaptionDataset", "folder='/etc'"),
    (lambda g, n: g[n["SegCkptSchedule"]]["inputs"].update(family="ideogram4", gradient_checkpointing_backend="torch-ffn"),
     "SegCkptSchedule", "no FFN boundary"),
])
def test_invalid_inputs_are_refused_at_validation_naming_node_and_input(server, ws, mutate, node_class, text):
    graph = _short(api_workflow("train_segmented_lora.api.json"), steps=1)
    ids = {v["class_type"]: k for k, v in graph.items()}
    mutate(graph, ids)
    status, body = queue(server, ws, graph)
    assert text in _errors(body, ids[node_class]), body["node_errors"]
    if node_class == "SegCkptSaveLoRA":
        # ComfyUI still runs the prompt's other, valid outputs (Loss Graph, Run Report): 200 with
        # node_errors; the refused Save LoRA node never runs and nothing is written outside.
        assert status == 200, body
        ws.wait_for(finished(body["prompt_id"]))
        outputs = server.get(f"/history/{body['prompt_id']}")[body["prompt_id"]]["outputs"]
        assert ids["SegCkptSaveLoRA"] not in outputs and ids["SegCkptRunReport"] in outputs, server.get(f"/history/{body['prompt_id']}")
        assert not list(server.base.parent.glob("x*.safetensors")) and not list(server.base.glob("*/x*.safetensors"))
    else:
        assert status == 400, body


NODE_ERROR = "segmented_checkpointing.nodes.environment.NodeError"
ABSOLUTE = re.compile(r"(^|[\s'\"(=,\[])/[^\s'\"/]+/")  # an absolute path (two components at least)


def _no_path(server, text: str) -> bool:
    return str(server.base) not in text and "custom_nodes" not in text and not ABSOLUTE.search(text)


@pytest.mark.parametrize("node_class, changes, input_name", [
    ("SegCkptTrainLoRA", {"run_name": "../up"}, "run_name"),
    ("SegCkptTrainLoRA", {"preview_every": -1}, "preview_every"),
    ("SegCkptSchedule", {"gradient_checkpointing_interval": 4, "gradient_checkpointing_segment_stride": 2},
     "gradient_checkpointing_segment_stride"),
])
def test_a_refused_value_names_the_nodes_own_input_and_no_path(server, ws, node_class, changes, input_name):
    """ComfyUI reports a fed node's refused value under the consumer's input (Train LoRA's error as
    Save LoRA's ``run``): the pack's middleware names the node's own input; the type holds no path."""
    graph = _short(api_workflow("train_segmented_lora.api.json"), steps=1)
    ids = {v["class_type"]: k for k, v in graph.items()}
    graph[ids[node_class]]["inputs"].update(changes)
    status, body = queue(server, ws, graph)
    assert status == 400, body
    errors = body["node_errors"][ids[node_class]]["errors"]
    assert len(errors) == 1 and errors[0]["extra_info"]["input_name"] == input_name, errors
    assert errors[0]["details"].startswith(f"{input_name}=") and errors[0]["extra_info"]["exception_type"] == NODE_ERROR
    assert _no_path(server, json.dumps(errors))


@pytest.mark.parametrize("workflow, node_class, changes, details", [
    ("train_segmented_lora.api.json", "SegCkptImageCaptionDataset", {"folder": "no_such_folder"},
     "folder='no_such_folder' is invalid: no such folder under the input folder"),
    ("train_segmented_lora.api.json", "SegCkptLoadDiffusionModel", {"source": "diffusion_models/missing.safetensors"},
     "source='diffusion_models/missing.safetensors' is invalid: no such .safetensors or .gguf file under models/unet, "
     "models/diffusion_models, output/diffusion_models"),
    ("checkpointing_sweep.api.json", "SegCkptSweep", {"run_name": "../up"},  # an output node's own validator
     "run_name='../up' is invalid: allowed a relative name inside output/segckpt, without '..' or an absolute path"),
])
def test_one_cause_is_one_error_on_the_input_that_holds_it(server, ws, workflow, node_class, changes, details):
    """A missing data folder was listed once per Dataset widget (8 errors), a missing model file named
    models/diffusion_models twice (ComfyUI searches output/diffusion_models too), and an output
    node's refusal was named by no input."""
    graph = _short(api_workflow(workflow), steps=1)
    node = node_id_of(graph, node_class)
    graph[node]["inputs"].update(changes)
    status, body = queue(server, ws, graph)
    assert status == 400, body
    errors = [(node_id, error) for node_id, entry in body["node_errors"].items() for error in entry["errors"]]
    assert len(errors) == 1, body["node_errors"]
    (where, error), (input_name,) = errors[0], changes
    assert where == node and error["details"] == details and error["extra_info"]["input_name"] == input_name, error
    assert "traceback" not in error["extra_info"]


def test_a_failed_run_reports_no_server_path_in_history(server, ws):
    broken = server.base / "models" / "diffusion_models" / "broken.safetensors"
    broken.write_bytes(b"not a model at all")
    graph = _short(api_workflow("train_segmented_lora.api.json"), steps=1)
    graph[node_id_of(graph, "SegCkptLoadDiffusionModel")]["inputs"]["source"] = "diffusion_models/broken.safetensors"
    status, body = queue(server, ws, graph)
    assert status == 200, body
    end = ws.wait_for(finished(body["prompt_id"]))
    assert end["type"] == "execution_error", end
    entry = server.get(f"/history/{body['prompt_id']}")[body["prompt_id"]]
    errors = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert len(errors) == 1 and errors[0]["exception_type"] == end["data"]["exception_type"] == NODE_ERROR, errors
    message = errors[0]["exception_message"]
    assert "models/diffusion_models/broken.safetensors" in message and _no_path(server, message), message
    assert _no_path(server, end["data"]["exception_message"])


def test_offload_node_is_optional(server, ws):
    graph = _short(api_workflow("train_with_offload.api.json"), steps=2)
    offload = node_id_of(graph, "SegCkptOffloadOptions")
    del graph[offload]
    del graph[node_id_of(graph, "SegCkptTrainLoRA")]["inputs"]["offload"]
    status, body = queue(server, ws, graph)
    assert status == 200, body
    ws.wait_for(finished(body["prompt_id"]))
    assert server.get(f"/history/{body['prompt_id']}")[body["prompt_id"]]["status"]["status_str"] == "success"


def test_interrupt_after_step_2_leaves_a_resumable_state(server, ws):
    graph = _short(api_workflow("train_segmented_lora.api.json"), steps=40)
    train = node_id_of(graph, "SegCkptTrainLoRA")
    graph[train]["inputs"]["run_name"] = "interrupted_run"
    status, body = queue(server, ws, graph)
    assert status == 200, body
    prompt_id = body["prompt_id"]
    ws.wait_for(lambda m: m["type"] == "progress" and m["data"].get("node") == train and m["data"]["value"] >= 2)
    assert server.request("/interrupt", {})[0] == 200
    end = ws.wait_for(finished(prompt_id))
    assert end["type"] == "execution_interrupted", end
    run = server.base / "output" / "segckpt" / "interrupted_run_00001"  # a queue trains into a new numbered run
    assert (run / STATE_FILE).is_file()
    header = read_state_header(run)
    assert 2 <= header["step"] < 40 and header["config"]["steps"] == 40


def test_plan_route(server):
    status, plan = server.request("/segckpt/plan?family=flux&size=tiny&gradient_checkpointing_interval=2"
                                  "&gradient_checkpointing_segment_stride=4")
    assert status == 200 and plan["block_map"]["double"] == "CC..CC.."
    status, body = server.request("/api/segckpt/plan?family=not-a-family")
    assert status == 400 and "family='not-a-family'" in body["error"]


def test_every_workflow_queued_twice_completes_into_two_runs(server, ws):
    for name in WORKFLOWS:
        graph = _short(api_workflow(name))
        for _ in range(2):
            status, body = queue(server, ws, graph)
            assert status == 200, body
            end = ws.wait_for(finished(body["prompt_id"]))
            assert end["type"] != "execution_error", (end["data"].get("node_type"), end["data"].get("exception_message"))
        node = next(n for n in graph.values() if "run_name" in n["inputs"])
        run_name = node["inputs"]["run_name"]
        runs = sorted(p.name for p in (server.base / "output" / "segckpt").glob(f"{run_name}_*") if p.is_dir())
        assert len(runs) >= 2 and runs[-2:] == [f"{run_name}_{n:05d}" for n in (len(runs) - 1, len(runs))], runs


@pytest.mark.parametrize("name, kind", [("checkpointing_sweep.api.json", "SegCkptSweep"),
                                        ("plan_then_train.api.json", "SegCkptSchedulePlanner")])
def test_interrupt_ends_a_measurement_within_one_step(server, ws, name, kind):
    graph = api_workflow(name)
    node = node_id_of(graph, kind)
    graph[node]["inputs"]["measured_steps"] = 50  # far longer than the test waits
    status, body = queue(server, ws, graph)
    assert status == 200, body
    prompt_id = body["prompt_id"]
    ws.wait_for(lambda m: m["type"] == "progress" and m["data"].get("node") == node and m["data"]["value"] >= 3)
    assert server.request("/interrupt", {})[0] == 200
    at = max(m["data"]["value"] for m in ws.messages if m["type"] == "progress" and m["data"].get("node") == node)
    end = ws.wait_for(finished(prompt_id), timeout=60)
    assert end["type"] == "execution_interrupted", end
    after = max(m["data"]["value"] for m in ws.messages if m["type"] == "progress" and m["data"].get("node") == node)
    assert after - at <= 1, (at, after)  # at most the step that was running when Cancel came


def test_errors_name_no_server_path_and_a_bad_key_once(server, ws):
    graph = api_workflow("train_segmented_lora.api.json")
    ids = {node["class_type"]: node_id for node_id, node in graph.items()}
    graph[ids["SegCkptSchedule"]]["inputs"].update(gradient_checkpointing_interval=4,
                                                   gradient_checkpointing_segment_stride=2)
    graph[ids["SegCkptImageCaptionDataset"]]["inputs"].update(folder="../outside")
    status, body = queue(server, ws, graph)
    assert status == 400
    schedule_errors = body["node_errors"][ids["SegCkptSchedule"]]["errors"]
    assert len(schedule_errors) == 1 and "gradient_checkpointing_segment_stride=2" in schedule_errors[0]["details"]
    for errors in body["node_errors"].values():
        for error in errors["errors"]:
            text = f"{error.get('message')} {error.get('details')}"
            assert str(server.base) not in text and "/tmp/" not in text, text
    # an execution error (a run that cannot resume) reaches the page without paths either
    graph = _short(api_workflow("train_segmented_lora.api.json"))
    graph[ids["SegCkptTrainLoRA"]]["inputs"].update(resume=True, run_name="never_ran")
    status, body = queue(server, ws, graph)
    assert status == 200, body
    end = ws.wait_for(finished(body["prompt_id"]))
    assert end["type"] == "execution_error"
    message = end["data"]["exception_message"]
    assert "resume=true: there is no run 'never_ran'" in message and str(server.base) not in message


def _expected_mmdit_deltas(lora_file: Path, shapes: dict) -> dict:
    """What a LoRA file of ``lora_format comfyui`` changes, in the original MMDiT keys: ``lora_up @
    lora_down`` per ``diffusion_model.<key>`` (the scale is folded into ``lora_up``), the changed
    weights only; the names checked against the published key mapping (original_layouts.sd3_to_mmdit)."""
    tensors = load_file(lora_file)
    original = sd3_to_mmdit({k: torch.zeros(v) for k, v in shapes.items()})
    deltas = {}
    for key, down in tensors.items():
        if key.endswith(".lora_down.weight"):
            weight = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight") + ".weight"
            assert weight in original, weight
            deltas[weight] = tensors[key.replace(".lora_down.", ".lora_up.")].float() @ down.float()
    return deltas


def test_closed_loop_trains_then_samples_with_the_lora_on_comfyuis_model(server, ws):
    """Single-file model through ComfyUI's loaders and ours, ComfyUI's encoders as the data, the
    trained LoRA applied by LoraLoaderModelOnly to ComfyUI's own MODEL and sampled by KSampler."""
    graph = _short(api_workflow("closed_loop_sd3.api.json"))
    train, save = node_id_of(graph, "SegCkptTrainLoRA"), node_id_of(graph, "SegCkptSaveLoRA")
    graph[train]["inputs"]["learning_rate"] = 1e-2  # a LoRA delta far above the comparison's tolerance
    _, history = _completed(server, ws, graph)
    image = history["outputs"][node_id_of(graph, "SaveImage")]["images"][0]
    assert (server.base / "output" / image["subfolder"] / image["filename"]).is_file()
    previews = [m["data"] for m in ws.messages if m["type"] == "segckpt.preview" and m["data"]["node"] == train]
    assert [p["step"] for p in previews] == [2, 4]
    shown = previews[-1]["images"][0]
    assert (server.base / "output" / shown["subfolder"] / shown["filename"]).is_file()
    lora_name = history["outputs"][save]["text"][0].split()[1].removeprefix("models/loras/")
    assert "lora key not loaded" not in server.log()

    # the same file applied to ComfyUI's MODEL outside the server: every key used, the patched
    # weights equal the trained adapter's delta
    lora_file = server.base / "models" / "loras" / lora_name
    out = server.base / "comfy_deltas.safetensors"
    model_file = server.base / "models" / "diffusion_models" / TRANSFORMER
    done = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), str(ROOT / "tests" / "live" / "comfy_lora_check.py"),
                           str(comfyui_path()), str(model_file), str(lora_file), str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lora key not loaded" not in done.stdout, done.stdout
    got = load_file(out)
    expected = _expected_mmdit_deltas(lora_file, {k: v.shape for k, v in tiny_sd3_transformer().state_dict().items()})
    assert got.keys() == expected.keys()
    changed = set(expected)
    # to_q/k/v -> one fused qkv, to_out.0 -> proj; attn in both blocks, attn2 in block 0: 6 weights
    assert len(changed) == 6
    assert max(expected[k].abs().max().item() for k in changed) > 1e-3  # a delta the check can see
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_closed_loop_of_flux_and_wan_runs_through_prompt_to_an_image(server, ws, family):
    """The shipped closed loop, its text encoder replaced as :func:`_short` says."""
    graph = _short(api_workflow(f"closed_loop_{family}.api.json"))
    _, history = _completed(server, ws, graph)
    image = history["outputs"][node_id_of(graph, "SaveImage")]["images"][0]
    assert (server.base / "output" / image["subfolder"] / image["filename"]).is_file()
    saved = history["outputs"][node_id_of(graph, "SegCkptSaveLoRA")]["text"][0]
    assert "(comfyui;" in saved, saved
    assert "lora key not loaded" not in server.log()


def test_a_clip_from_load_video_trains_wan_through_comfyuis_vae(server, ws):
    """Core Load Video -> Get Video Components -> Train LoRA's images (+ caption), encoded by the
    graph's Wan VAE (ComfyUI's class): the run trains on the clip's 9 frames (3 latent frames)."""
    from clips import pan_frames, write_mp4

    write_mp4(server.base / "input" / "segckpt_pan.mp4", pan_frames(10, (64, 64)))
    run_name = f"clip_{uuid.uuid4().hex[:8]}"
    graph = {
        "1": {"class_type": "LoadVideo", "inputs": {"file": "segckpt_pan.mp4"}},
        "2": {"class_type": "GetVideoComponents", "inputs": {"video": ["1", 0]}},
        "3": {"class_type": "SegCkptLoadDiffusionModel", "inputs": {"family": "wan", "source": "(tiny preset)",
                                                                     "seed": 0, "base_model_precision": "auto"}},
        "4": {"class_type": "SegCkptSchedule", "inputs": {
            "family": "wan", "gradient_checkpointing": True, "gradient_checkpointing_backend": "torch",
            "gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4,
            "gradient_checkpointing_offload_attention": False, "gradient_checkpointing_offload_pin_memory_max_buckets": 0}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": CLOSED_LOOP_FILES["wan"][1]}},
        "6": {"class_type": "SegCkptTrainLoRA", "inputs": {
            "model": ["3", 0], "schedule": ["4", 0], "images": ["2", 0], "caption": "a camera pan over a photo",
            "vae": ["5", 0], "steps": 2, "learning_rate": 1e-3, "lr_scheduler": "constant", "batch_size": 1,
            "gradient_accumulation_steps": 1, "seed": 0, "run_name": run_name, "resume": False}},
        "7": {"class_type": "SegCkptRunReport", "inputs": {"run": ["6", 0]}},
    }
    _completed(server, ws, graph)
    report = json.loads((server.base / "output" / "segckpt" / f"{run_name}_00001" / "report.json").read_text())
    assert report["dataset"]["frames"] == {"given": 10, "trained": 9, "frame_sampling": "first"}
    assert report["dataset"]["latent_shape"] == [16, 3, 8, 8]
    assert len(report["steps"]) == 2 and all(math.isfinite(h["loss"]) for h in report["steps"])
