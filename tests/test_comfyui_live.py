"""The pack inside a real ComfyUI server (skipped unless ``COMFYUI_PATH`` is set; see live_comfyui.py)."""

from __future__ import annotations

import copy
import uuid

import pytest
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

from segmented_checkpointing.engine.train.state import STATE_FILE, read_state_header

WORKFLOWS = tuple(sorted(p.name for p in (ROOT / "workflows" / "api").glob("*.api.json")))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkout = comfyui_path()
    running = Server(checkout, tmp_path_factory.mktemp("comfyui-base"))
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
        if node["class_type"] == "SegCkptTrainLoRA":
            inputs["steps"] = steps
        if node["class_type"] == "SegCkptImageCaptionDataset":
            inputs["resolution"] = 64
        if "measured_steps" in inputs:
            inputs["measured_steps"] = 1
        if "run_name" in inputs:  # a new run folder (no overwrite refusal)
            inputs["run_name"] = f"{inputs['run_name']}_{uuid.uuid4().hex[:8]}"
    return graph


def test_pack_loads_and_lists_every_node(server):
    log = server.log()
    assert "IMPORT FAILED" not in log and "Traceback" not in log, log[-3000:]
    assert "comfyui-segmented-checkpointing" in log
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
    status, body = queue(server, ws, graph)
    assert status == 200, body
    prompt_id = body["prompt_id"]
    end = ws.wait_for(finished(prompt_id))
    assert end["type"] != "execution_error", end
    history = server.get(f"/history/{prompt_id}")[prompt_id]
    assert history["status"]["status_str"] == "success", history["status"]
    if not any(node["class_type"] == "SegCkptTrainLoRA" for node in graph.values()):
        sweep = node_id_of(graph, "SegCkptSweep")
        assert history["outputs"][sweep]["images"][0]["filename"] == "sweep.png"
        return
    train = node_id_of(graph, "SegCkptTrainLoRA")
    steps = graph[train]["inputs"]["steps"]
    progress = [m["data"] for m in ws.messages
                if m["type"] == "progress" and m["data"].get("node") == train and m["data"].get("prompt_id") == prompt_id]
    assert [p["value"] for p in progress] == list(range(1, steps + 1))
    assert all(p["max"] == steps for p in progress)
    losses = [m["data"] for m in ws.messages if m["type"] == "segckpt.loss" and m["data"]["node"] == train]
    assert [m["step"] for m in losses][-steps:] == list(range(1, steps + 1))
    save = node_id_of(graph, "SegCkptSaveLoRA")
    assert history["outputs"][save]["text"][0].endswith(".safetensors")


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
    run = server.base / "output" / "segckpt" / "interrupted_run"
    assert (run / STATE_FILE).is_file()
    header = read_state_header(run)
    assert 2 <= header["step"] < 40 and header["config"]["steps"] == 40


def test_plan_route(server):
    status, plan = server.request("/segckpt/plan?family=flux&size=tiny&gradient_checkpointing_interval=2"
                                  "&gradient_checkpointing_segment_stride=4")
    assert status == 200 and plan["block_map"]["double"] == "CC..CC.."
    status, body = server.request("/api/segckpt/plan?family=not-a-family")
    assert status == 400 and "family='not-a-family'" in body["error"]
