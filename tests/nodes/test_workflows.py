"""Each drag-and-drop (UI-format) workflow does the same as its API-format twin."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.v3 import io

FOLDER = Path(__file__).resolve().parents[2] / "workflows"
_SPEC = importlib.util.spec_from_file_location("make_ui", FOLDER / "make_ui.py")
make_ui = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_ui)
UI_FILES = sorted(FOLDER.glob("*.json"))
WIDGET_TYPES = ("COMBO", "INT", "FLOAT", "BOOLEAN", "STRING")
SEED_CONTROLS = ("fixed", "increment", "decrement", "randomize")


# ComfyUI 0.3.64's own nodes used by the shipped workflows: their widgets in the frontend's order
# (name, has a control_after_generate widget after it); None: a frontend-only widget (LoadImage's
# upload button), not sent to the server.
CORE_WIDGETS = {
    "UNETLoader": [("unet_name", False), ("weight_dtype", False)],
    "CLIPLoader": [("clip_name", False), ("type", False), ("device", False)],
    "VAELoader": [("vae_name", False)],
    "DualCLIPLoader": [("clip_name1", False), ("clip_name2", False), ("type", False), ("device", False)],
    "FluxGuidance": [("guidance", False)],
    "EmptyHunyuanLatentVideo": [("width", False), ("height", False), ("length", False), ("batch_size", False)],
    "LoadImage": [("image", False), None],
    "ImageScale": [("upscale_method", False), ("width", False), ("height", False), ("crop", False)],
    "ImageBatch": [], "LatentBatch": [], "VAEEncode": [], "VAEDecode": [], "ConditioningCombine": [],
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



@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_links_join_the_slots_that_name_them_in_execution_order(ui_file):
    ui = json.loads(ui_file.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for link_id, origin, origin_slot, target, target_slot, kind in ui["links"]:
        assert nodes[target]["inputs"][target_slot]["link"] == link_id, (link_id, nodes[target]["inputs"][target_slot])
        assert nodes[target]["inputs"][target_slot]["type"] == kind
        assert link_id in nodes[origin]["outputs"][origin_slot]["links"]
        assert nodes[origin]["order"] < nodes[target]["order"]
    assert sorted(n["order"] for n in ui["nodes"]) == list(range(len(nodes)))
    assert (ui["last_node_id"], ui["last_link_id"]) == (max(nodes), max((link[0] for link in ui["links"]), default=0))

TITLE = make_ui.TITLE
VIEW = (1280, 720)  # the smallest common screen's canvas; the frontends open a workflow at its extra.ds
CHROME = (60, 60)  # the canvas under frontend 1.58's sidebar and graph breadcrumb
SIZES = make_ui.node_sizes()  # each node type's smallest size on the real frontends (measured)


def _boxes(ui: dict, api: dict) -> list[tuple[str, float, float, float, float]]:
    """Each node's box as the frontend shows it: its title bar, its size (at least its type's measured
    size: the frontend grows a smaller node) and what a run adds below it (make_ui.run_reserve)."""
    guarded = any(n["type"] == "SegCkptFitGuardrails" for n in ui["nodes"])
    boxes = []
    for n in ui["nodes"]:
        (x, y), size = n["pos"], [max(a, b) for a, b in zip(n["size"], SIZES[n["type"]])]
        reserve = make_ui.run_reserve(n["type"], api[str(n["id"])]["inputs"], guarded)
        boxes.append((f"{n['id']} {n['type']}", x, y - TITLE, x + size[0], y + size[1] + reserve))
    return boxes


def _overlap(a, b) -> bool:
    return a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]


@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_no_node_covers_another_at_its_measured_size_and_the_strip_is_in_view(ui_file):
    """Every node ships at least at its type's measured size (the frontend grows a smaller one when it
    loads the workflow, over whatever lies below), and no node's box, with room for its results,
    overlaps another's."""
    ui = json.loads(ui_file.read_text())
    api = json.loads((FOLDER / "api" / f"{ui_file.stem}.api.json").read_text())
    small = [(n["id"], n["type"], n["size"], SIZES[n["type"]]) for n in ui["nodes"]
             if any(have < need for have, need in zip(n["size"], SIZES[n["type"]]))]
    boxes = _boxes(ui, api)
    overlaps = [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b)]
    assert overlaps == [], ui_file.name
    assert small == [], f"{ui_file.name}: nodes smaller than the frontend makes them: {small}"
    groups = [(g["title"], g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
               g["bounding"][1] + g["bounding"][3]) for g in ui.get("groups", [])]
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            assert not _overlap(a, b), (ui_file.name, a[0], b[0])
    ds = ui["extra"]["ds"]
    for name, x0, y0, x1, y1 in boxes:
        kind = name.split()[1]
        if kind in ("SegCkptSchedule", "SegCkptTrainLoRA", "SegCkptSchedulePlanner"):
            screen = [(v + ds["offset"][i % 2]) * ds["scale"] for i, v in enumerate((x0, y0, x1, y1))]
            assert CHROME[0] <= screen[0] and CHROME[1] <= screen[1], (kind, screen)  # not under the frontend's bars
            assert screen[2] <= VIEW[0] and screen[3] <= VIEW[1], (kind, screen)


def test_lay_out_stacks_columns_from_the_measured_sizes():
    """Positions follow from the sizes: a column's next node starts below the last one's reserve, the
    next column right of the widest node; a group encloses its nodes below its title band."""
    api = {"1": {"class_type": "SegCkptSchedule", "inputs": {}}, "2": {"class_type": "SegCkptLoRAConfig", "inputs": {}},
           "3": {"class_type": "SegCkptTrainLoRA", "inputs": {"preview_every": 5}}}
    sizes = {"SegCkptSchedule": [438, 298], "SegCkptLoRAConfig": [210, 130], "SegCkptTrainLoRA": [309, 698]}
    gap_x, gap_y = make_ui.GAP
    placed, groups = make_ui.lay_out(api, {"columns": [["1", "2"], ["3"]], "nodes": {"2": {"size": [270, 100]}}}, sizes)
    assert placed == {"1": {"pos": [20, 20 + TITLE], "size": [438, 298]},
                      "2": {"pos": [20, 20 + TITLE + 298 + 40 + gap_y + TITLE], "size": [270, 130]},  # reserve: 40
                      "3": {"pos": [20 + 438 + gap_x, 20 + TITLE], "size": [309, 698]}}
    assert groups == []
    layout = {"rows": [[{"title": "T", "color": "#fff", "columns": [["3"]]}], [{"columns": [["1"]]}]]}
    placed, groups = make_ui.lay_out({k: api[k] for k in ("1", "3")}, layout, sizes)
    pad, header = make_ui.GROUP_PAD, make_ui.GROUP_HEADER
    bottom = 20 + header + TITLE + 698 + make_ui.TRAIN_PREVIEWS + pad
    assert groups == [{"title": "T", "color": "#fff", "bounding": [20, 20, pad + 309 + pad, bottom - 20]}]
    assert placed["3"]["pos"] == [20 + pad, 20 + header + TITLE] and placed["1"]["pos"] == [20, bottom + gap_y + TITLE]
    with pytest.raises(ValueError, match=r"in no column: \['3'\]"):
        make_ui.lay_out(api, {"columns": [["1", "2"]]}, sizes)
    with pytest.raises(ValueError, match="no measured size for node type SegCkptLoRAConfig"):
        make_ui.lay_out(api, {"columns": [["1", "2", "3"]]}, {k: v for k, v in sizes.items() if "LoRAConfig" not in k})


def test_every_committed_workflow_is_what_the_generator_writes():
    """A hand edit of a UI or API file fails here: edit the API file or the layout sidecar, run make_ui.py."""
    texts = make_ui.generate()
    assert {p.name for p in texts if p.parent == FOLDER} == {p.name for p in UI_FILES}
    assert sorted(p.stem for p in (FOLDER / "layout").glob("*.json")) == sorted(p.stem for p in UI_FILES)
    stale = [str(p.relative_to(FOLDER)) for p, text in texts.items() if p.read_text(encoding="utf-8") != text]
    assert stale == [], f"run: python workflows/make_ui.py (differs: {stale})"
    assert make_ui.main(["--check"]) == 0


def test_a_new_node_input_reaches_both_graphs_with_its_default(monkeypatch, tmp_path):
    """An input added to a node's schema needs no hand edit: the generator puts its default in both files."""
    train = NODES["SegCkptTrainLoRA"]
    declared = train.define_schema

    def more_inputs():
        schema = declared()
        schema.inputs = [*schema.inputs, io.Boolean.Input("new_switch", default=True),
                         io.Combo.Input("new_mode", options=["fast", "slow"], optional=True),
                         io.Int.Input("new_count", default=7, min=0, optional=True)]
        return schema

    monkeypatch.setattr(train, "define_schema", staticmethod(more_inputs))
    for name in ("api", "layout"):
        (tmp_path / name).mkdir()
    for path in [*(FOLDER / "api").glob("*.api.json"), *(FOLDER / "layout").glob("*.json")]:
        (tmp_path / path.parent.name / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    committed = {p: p.read_text(encoding="utf-8") for p in FOLDER.glob("**/*.json")}
    texts = make_ui.generate(tmp_path)
    checked = 0
    for path, text in texts.items():
        if path.parent != tmp_path:
            continue
        ui, api = json.loads(text), json.loads(texts[tmp_path / "api" / f"{path.stem}.api.json"])
        mine = _as_api(ui)  # reads the patched schema too
        assert mine == {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
        for node in (n for n in ui["nodes"] if n["type"] == "SegCkptTrainLoRA"):
            inputs = api[str(node["id"])]["inputs"]
            assert (inputs["new_switch"], inputs["new_mode"], inputs["new_count"]) == (True, "fast", 7)
            slots = {s["name"]: s for s in node["inputs"]}
            assert slots["new_count"]["widget"] == {"name": "new_count"} and slots["new_count"]["shape"] == 7
            assert "shape" not in slots["new_switch"]
            assert node["widgets_values_named"]["new_count"] == 7
            checked += 1
    assert checked  # Train LoRA is in several shipped workflows
    assert {p: p.read_text(encoding="utf-8") for p in committed} == committed  # nothing on disk changed
