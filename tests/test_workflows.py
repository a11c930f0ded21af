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


def _widget_names(cls) -> list[tuple[str, bool]]:
    """(name, has a control_after_generate widget after it), in the order the frontend makes widgets."""
    declared = cls.INPUT_TYPES()
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
        cls = NODES[node["type"]]
        values = list(node.get("widgets_values") or [])
        inputs = {}
        for name, control in _widget_names(cls):
            inputs[name] = values.pop(0)
            if control:
                assert values.pop(0) == "fixed", f"{node['type']}.{name}: seed control must be 'fixed' (reproducible)"
        assert not values, f"node {node['id']} ({node['type']}): extra widget values {values}"
        for slot in node.get("inputs") or []:
            if slot.get("link") is not None:
                _, origin, origin_slot, target, _, _ = links[slot["link"]]
                assert target == node["id"]
                inputs[slot["name"]] = [str(origin), origin_slot]
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


def _boxes(ui: dict) -> list[tuple[str, float, float, float, float]]:
    return [(n["type"], n["pos"][0], n["pos"][1] - TITLE, n["pos"][0] + n["size"][0],
             n["pos"][1] + n["size"][1] + RUNTIME_EXTRA.get(n["type"], 0)) for n in ui["nodes"]]


@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_no_node_covers_another_and_the_strip_is_in_view(ui_file):
    ui = json.loads(ui_file.read_text())
    boxes = _boxes(ui)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]), (ui_file.name, a[0], b[0])
    ds = ui["extra"]["ds"]
    for kind, x0, y0, x1, y1 in boxes:
        if kind in ("SegCkptSchedule", "SegCkptTrainLoRA", "SegCkptSchedulePlanner"):
            screen = [(v + ds["offset"][i % 2]) * ds["scale"] for i, v in enumerate((x0, y0, x1, y1))]
            assert 0 <= screen[0] and 0 <= screen[1] and screen[2] <= VIEW[0] and screen[3] <= VIEW[1], (kind, screen)
