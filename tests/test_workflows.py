"""Each drag-and-drop (UI-format) workflow does the same as its API-format twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES

FOLDER = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(FOLDER.glob("*.json"))
WIDGET_TYPES = ("INT", "FLOAT", "BOOLEAN", "STRING")
SEED_CONTROLS = ("fixed", "increment", "decrement", "randomize")


# ComfyUI 0.3.64's own nodes used by the shipped workflows: their widgets in the frontend's order
# (name, has a control_after_generate widget after it); None: a frontend-only widget (LoadImage's
# upload button), not sent to the server.
CORE_WIDGETS = {
    "UNETLoader": [("unet_name", False), ("weight_dtype", False)],
    "CLIPLoader": [("clip_name", False), ("type", False), ("device", False)],
    "VAELoader": [("vae_name", False)],
    "LoadImage": [("image", False), None],
    "ImageScale": [("upscale_method", False), ("width", False), ("height", False), ("crop", False)],
    "ImageBatch": [], "VAEEncode": [], "VAEDecode": [], "ConditioningCombine": [],
    "CLIPTextEncode": [("text", False)],
    "LoraLoaderModelOnly": [("lora_name", False), ("strength_model", False)],
    "EmptySD3LatentImage": [("width", False), ("height", False), ("batch_size", False)],
    "KSampler": [("seed", True), ("steps", False), ("cfg", False), ("sampler_name", False), ("scheduler", False),
                 ("denoise", False)],
    "SaveImage": [("filename_prefix", False)],
}


def _widget_names(kind: str) -> list[tuple[str, bool] | None]:
    """(name, has a control_after_generate widget after it), in the order the frontend makes widgets."""
    if kind in CORE_WIDGETS:
        return CORE_WIDGETS[kind]
    declared = NODES[kind].INPUT_TYPES()
    names = []
    for section in ("required", "optional"):
        for name, spec in declared.get(section, {}).items():
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(kind, list) or kind in WIDGET_TYPES:
                control = kind == "INT" and (name in ("seed", "noise_seed") or options.get("control_after_generate"))
                names.append((name, bool(control)))
    return names


def _as_api(ui: dict) -> dict:
    """The API-format graph a UI-format workflow queues (ComfyUI's graphToPrompt, for our nodes)."""
    links = {link[0]: link for link in ui["links"]}
    graph = {}
    for node in ui["nodes"]:
        values = list(node.get("widgets_values") or [])
        inputs = {}
        for widget in _widget_names(node["type"]):
            value = values.pop(0)
            if widget is None:
                continue
            name, control = widget
            inputs[name] = value
            if control:
                assert values.pop(0) == "fixed", f"{node['type']}.{name}: seed control must be 'fixed' (reproducible)"
        assert not values, f"node {node['id']} ({node['type']}): extra widget values {values}"
        for slot in node.get("inputs") or []:
            if slot.get("link") is not None:
                _, origin, origin_slot, target, _, _ = links[slot["link"]]
                assert target == node["id"]
                inputs[slot["name"]] = [str(origin), origin_slot]  # a linked widget: the link wins
        graph[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return graph


def _same_values(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)  # JSON from the browser writes 16.0 as 16
    return a == b


def test_every_ui_workflow_has_an_api_twin():
    assert {p.stem for p in UI_FILES} == {p.name.removesuffix(".api.json") for p in (FOLDER / "api").glob("*.api.json")}
    assert len(UI_FILES) >= 2


@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_matches_its_api_twin(ui_file):
    ui = json.loads(ui_file.read_text())
    assert "nodes" in ui and "links" in ui, "not a UI-format workflow"
    api = json.loads((FOLDER / "api" / f"{ui_file.stem}.api.json").read_text())
    mine = _as_api(ui)
    assert {k: v["class_type"] for k, v in mine.items()} == {k: v["class_type"] for k, v in api.items()}
    for node_id, node in api.items():
        got = mine[node_id]["inputs"]
        assert got.keys() == node["inputs"].keys(), node_id
        for name, value in node["inputs"].items():
            assert _same_values(got[name], value), f"node {node_id} input {name}: UI {got[name]!r} != API {value!r}"


# What the pack's frontend adds under a node's widgets once it runs (pixels): the schedule strip,
# the live loss curve, the result text of report / planner / sweep / save, the loss image.
RUNTIME_EXTRA = {"SegCkptSchedule": 140, "SegCkptTrainLoRA": 110, "SegCkptRunReport": 190,
                 "SegCkptSchedulePlanner": 190, "SegCkptSaveLoRA": 60, "SegCkptSweep": 190, "SegCkptLossGraph": 200}
TITLE = 30
VIEW = (1280, 720)  # the smallest common screen's canvas; the frontends open a workflow at its extra.ds
CHROME = (60, 60)  # the canvas under frontend 1.58's sidebar and graph breadcrumb


PREVIEWS = 112  # Train LoRA's preview row (web/train_loss_curve.js), when previews are on


NOTES = 6 * 14  # Train LoRA's guardrail lines (a verdict of two buckets, a switch), with Fit Guardrails


def _extra(node: dict, guarded: bool) -> float:
    extra = RUNTIME_EXTRA.get(node["type"], 0)
    if node["type"] == "SegCkptTrainLoRA":
        extra += PREVIEWS if node["widgets_values"][-1] else 0  # preview_every, its last widget
        extra += NOTES if guarded else 0
    return extra


def _boxes(ui: dict) -> list[tuple[str, float, float, float, float]]:
    guarded = any(n["type"] == "SegCkptFitGuardrails" for n in ui["nodes"])
    return [(n["type"], n["pos"][0], n["pos"][1] - TITLE, n["pos"][0] + n["size"][0],
             n["pos"][1] + n["size"][1] + _extra(n, guarded)) for n in ui["nodes"]]


@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_no_node_covers_another_and_the_strip_is_in_view(ui_file):
    ui = json.loads(ui_file.read_text())
    boxes = _boxes(ui)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]), (ui_file.name, a[0], b[0])
    groups = [(g["title"], g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
               g["bounding"][1] + g["bounding"][3]) for g in ui.get("groups", [])]
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            assert not (a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]), (ui_file.name, a[0], b[0])
    ds = ui["extra"]["ds"]
    for kind, x0, y0, x1, y1 in boxes:
        if kind in ("SegCkptSchedule", "SegCkptTrainLoRA", "SegCkptSchedulePlanner"):
            screen = [(v + ds["offset"][i % 2]) * ds["scale"] for i, v in enumerate((x0, y0, x1, y1))]
            assert CHROME[0] <= screen[0] and CHROME[1] <= screen[1], (kind, screen)  # not under the frontend's bars
            assert screen[2] <= VIEW[0] and screen[3] <= VIEW[1], (kind, screen)
