"""Drag-and-drop in headless Chromium against a real ComfyUI (skipped unless ``COMFYUI_PATH`` is set).

Needs Python's ``playwright`` package and a Chromium (``CHROMIUM_PATH``, default
``/usr/bin/chromium``; nothing is downloaded). The canvas screenshot is written to
``SEGCKPT_ARTIFACTS`` (default: the test's temporary folder) and its path printed. Each workflow's
canvas is checked as a user sees it (``canvas_geometry.py``): no node over another, nothing the pack
draws on a widget's row, after the drop and after the run.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from canvas_geometry import drawn_over_widgets, measured_sizes, overlapping_nodes
from comfy_models import write_closed_loop_files
from live_comfyui import ROOT, Server, comfyui_path

from segmented_checkpointing.engine.core.plan_query import reference_block_counts

UI_FILES = sorted((ROOT / "workflows").glob("*.json"))
SIZES = ROOT / "workflows" / "measured" / "node_sizes.json"
MEASURE = "SEGCKPT_MEASURE_NODE_SIZES"

DROP = """([name, text]) => {
  const data = new DataTransfer();
  data.items.add(new File([text], name, { type: "application/json" }));
  const target = document.querySelector("#graph-canvas") ?? document.querySelector("canvas");
  for (const type of ["dragenter", "dragover", "drop"]) {
    target.dispatchEvent(new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true }));
  }
}"""

SET_WIDGETS = """(changes) => {
  for (const node of window.app.graph._nodes) {
    for (const widget of node.widgets ?? []) {
      if (widget.name in changes) widget.value = changes[widget.name];
    }
  }
}"""


RESULTS = """() => window.app.graph._nodes.filter(n => n.segckptText || n.segckptNotes?.length).map(n => {
  const measure = document.createElement("canvas").getContext("2d");
  const [x, y, w, h] = window.app.canvas.visible_area;
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const panels = [[n.segckptText, n.segckptDrawn], [n.segckptNotes, n.segckptNotesDrawn]].filter(([text]) => text?.length)
    .map(([text, drawn]) => {
      if (!drawn) return { text, drawn: null };
      measure.font = drawn.font;
      return { text, drawn: drawn.lines, right: Math.max(...drawn.lines.map(l => drawn.x + measure.measureText(l).width)),
               bottom: drawn.y + (drawn.lines.length - (drawn.middle ? 0.5 : 0)) * drawn.line };
    });
  return { id: n.id, type: n.type, size: [...n.size], panels,
           onScreen: n.pos[0] >= x && n.pos[1] - title >= y && n.pos[0] + n.size[0] <= x + w && n.pos[1] + n.size[1] <= y + h };
})"""
"""Each node's result text as drawn on the canvas (``web/node_text.js``, Train LoRA's notes in
``web/train_loss_curve.js``): the lines drawn, the rightmost and lowest pixel of the text in node
coordinates, and whether the whole node lies in the view."""


def _words(lines) -> str:
    """The characters of ``lines`` but their spaces (a wrapped line breaks at spaces, or inside a
    file name)."""
    return "".join("".join(lines).split())


def _check_results_are_whole(page, history: dict, types: set) -> None:
    """Every result the run returned is drawn whole at the workflow's own view: each line within the
    node's width, the text's bottom within its height, nothing left out, the node in the view."""
    page.wait_for_function(f"() => ({RESULTS})().every(n => n.panels.every(p => p.drawn))", timeout=30_000)
    results = {str(r["id"]): r for r in page.evaluate(RESULTS)}
    for node_id, output in history["outputs"].items():
        if output.get("text"):
            text = "\n".join(output["text"]).splitlines()
            assert _words(results[node_id]["panels"][0]["drawn"]) == _words(text), (node_id, results[node_id])
    assert {r["type"] for r in results.values()} >= types & {"SegCkptSaveLoRA", "SegCkptRunReport", "SegCkptSweep",
                                                               "SegCkptSchedulePlanner"}
    for result in results.values():
        assert result["onScreen"], result
        for panel in result["panels"]:
            assert _words(panel["drawn"]) == _words(panel["text"]), result  # no line cut, none elided
            assert panel["right"] <= result["size"][0] and panel["bottom"] <= result["size"][1], result


def _check_canvas_geometry(page, when: str) -> list[dict]:
    """No two node boxes overlap; on every pack node nothing drawn lies on a widget's row or outside
    the node, at its size and resized to its smallest. Returns the pack nodes' drawings."""
    problems = [f"nodes overlap: {a} and {b}" for a, b in overlapping_nodes(page)]
    for shrink in (True, False):
        nodes, drawn = drawn_over_widgets(page, shrink)
        problems += [f"{'resized to its smallest: ' if shrink else ''}{line}" for line in drawn]
    assert not problems, f"{when}:\n" + "\n".join(problems)
    return nodes


def _check_node_sizes(page) -> bool:
    """The node sizes the workflows are laid out with (``workflows/measured/node_sizes.json``, read
    by ``workflows/make_ui.py``) hold every node on this frontend. With ``SEGCKPT_MEASURE_NODE_SIZES=1``
    this frontend's sizes are merged into that file instead (the larger of each), and True returned."""
    measured, stored = measured_sizes(page), json.loads(SIZES.read_text())
    if os.environ.get(MEASURE):
        for kind, size in measured.items():
            stored["sizes"][kind] = [max(a, b) for a, b in zip(stored["sizes"].get(kind, [0, 0]), size)]
        version = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__")
        stored["frontends"] = sorted(set(stored["frontends"]) | {version})
        lines = ",\n".join(f"    {json.dumps(kind)}: {json.dumps(size)}" for kind, size in sorted(stored["sizes"].items()))
        SIZES.write_text(f'{{\n  "frontends": {json.dumps(stored["frontends"])},\n  "sizes": {{\n{lines}\n  }}\n}}\n')
        return True
    small = {kind: {"stored": stored["sizes"].get(kind), "measured": size} for kind, size in measured.items()
             if any(m > s for m, s in zip(size, stored["sizes"].get(kind, [0, 0])))}
    assert not small, f"node sizes grew: measure them again ({MEASURE}=1, both frontends) and run make_ui.py: {small}"
    return False


def _texts(nodes: list[dict], kind: str) -> list[str]:
    return [box["text"] for node in nodes if node["type"] == kind for box in node["drawn"] if box["kind"] == "text"]


NOT_RUN_HERE = {"closed_loop_flux": "T5-XXL", "closed_loop_wan": "UMT5-XXL"}
"""UI workflows dropped and checked but not queued from the page: their text encoders (4.7B and 5.7B
parameters) are not written on a CPU runner; tests/live/test_comfyui_live.py runs them with CLIP-L
standing in."""


@pytest.fixture(scope="module")
def browser_server(tmp_path_factory):
    checkout = comfyui_path()
    playwright = pytest.importorskip("playwright.sync_api")
    chromium = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
    if not Path(chromium).exists():
        pytest.skip(f"no Chromium at {chromium} (set CHROMIUM_PATH)")
    base = tmp_path_factory.mktemp("comfyui-browser")
    write_closed_loop_files(base)  # the closed-loop workflow's model files and images
    server = Server(checkout, base)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield server, browser
        browser.close()
    server.stop()


def _new_history_entry(server: Server, known: set, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        history = server.get("/history")
        fresh = [v for k, v in history.items() if k not in known and v.get("status", {}).get("completed") is not None]
        if fresh:
            return fresh[0]
        time.sleep(1)
    raise TimeoutError("the queued workflow did not finish")


@pytest.mark.parametrize("ui_file", UI_FILES, ids=lambda p: p.name)
def test_drop_workflow_shows_the_plan_strip_and_runs(browser_server, ui_file, tmp_path):
    server, browser = browser_server
    workflow = json.loads(ui_file.read_text())
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    errors = []
    page.on("pageerror", lambda exc: errors.append(f"{exc}\n{exc.stack}"))
    page.goto(server.url, wait_until="networkidle", timeout=120_000)
    page.wait_for_function("() => window.app?.graph && document.querySelector('canvas')", timeout=120_000)
    page.wait_for_timeout(1000)
    page.keyboard.press("Escape")  # a fresh user directory gets the templates dialog on first load (1.58)
    page.wait_for_timeout(300)
    # frontend 1.27 throws one error of its own while loading its settings; ours must throw none
    assert not [e for e in errors if "comfyui-segmented-checkpointing" in e], errors
    errors.clear()

    page.evaluate(DROP, [ui_file.name, ui_file.read_text()])
    page.wait_for_function(f"() => window.app.graph._nodes.length === {len(workflow['nodes'])}", timeout=30_000)
    types = page.evaluate("() => window.app.graph._nodes.map(n => n.type).sort()")
    assert types == sorted(n["type"] for n in workflow["nodes"])

    types = {n["type"] for n in workflow["nodes"]}
    if "SegCkptSchedule" in types:
        page.wait_for_function("""() => window.app.graph._nodes.some(n => n.type === 'SegCkptSchedule'
            && n.segckpt?.plan?.block_map)""", timeout=60_000)
        plan = page.evaluate("() => window.app.graph._nodes.find(n => n.type === 'SegCkptSchedule').segckpt")
        loader = next(n for n in workflow["nodes"] if n["type"] == "SegCkptLoadDiffusionModel")
        assert plan["error"] is None and plan["plan"]["family"] == loader["widgets_values"][0]
        if loader["widgets_values"][1] == "(tiny preset)":
            assert plan["plan"]["size"] == "tiny"
            expected = dict(reference_block_counts(loader["widgets_values"][0], "tiny"))  # the family's tiny lists
            assert {name: len(m) for name, m in plan["plan"]["block_map"].items()} == expected
        else:  # a model file: the strip shows the family's full-size plan
            assert plan["plan"]["size"] == "full" and plan["plan"]["block_map"]
        offload = next((n for n in workflow["nodes"] if n["type"] == "SegCkptOffloadOptions"), None)
        if offload:  # the strip shows what Train LoRA runs: the offload node's backend over the schedule's
            assert plan["plan"]["mode"].endswith(f"-{offload['widgets_values'][0]}-offload-attn"), plan["plan"]["mode"]

    if _check_node_sizes(page):  # measured into the file: nothing else checked
        page.close()
        return
    nodes = _check_canvas_geometry(page, f"{ui_file.name} after the drop")
    if "SegCkptTrainLoRA" in types:
        assert "loss: waiting for the first step" in _texts(nodes, "SegCkptTrainLoRA")
    if ui_file.stem in NOT_RUN_HERE:  # dropped and drawn above; run through /prompt by the live tests
        assert not errors, errors
        page.close()
        return
    known = set(server.get("/history"))
    previews = any(n["type"] == "SegCkptTrainLoRA" and n["widgets_values_named"]["preview_every"] for n in workflow["nodes"])
    page.evaluate(SET_WIDGETS, {"steps": 3, "resolution": 64, "measured_steps": 1, "width": 64, "height": 64,
                                "run_name": f"browser_{uuid.uuid4().hex[:8]}", **({"preview_every": 3} if previews else {})})
    page.evaluate("() => window.app.queuePrompt(0, 1)")
    entry = _new_history_entry(server, known)
    assert entry["status"]["status_str"] == "success", entry["status"]
    _check_results_are_whole(page, entry, types)
    if "SegCkptTrainLoRA" in types:
        page.wait_for_function("""() => window.app.graph._nodes.some(n => n.type === 'SegCkptTrainLoRA'
            && n.segckptLoss?.history.length === 3)""", timeout=30_000)
    if "SegCkptFitGuardrails" in types:  # the pre-flight verdict, drawn on Train LoRA (after the unload note)
        page.wait_for_function("""() => window.app.graph._nodes.some(n => n.type === 'SegCkptTrainLoRA'
            && n.segckptNotes?.some(line => line.startsWith('pre-flight:')))""", timeout=30_000)
    if previews:  # the validation preview of step 3, loaded from the server and drawn on the node
        page.wait_for_function("""() => window.app.graph._nodes.some(n => n.type === 'SegCkptTrainLoRA'
            && n.segckptPreviews?.step === 3 && n.segckptPreviews.images[0]?.naturalWidth === 64)""", timeout=30_000)

    nodes = _check_canvas_geometry(page, f"{ui_file.name} after the run")
    if "SegCkptTrainLoRA" in types:  # what the checks above saw drawn: the results themselves
        assert any(text.startswith("step 3/3") for text in _texts(nodes, "SegCkptTrainLoRA")), nodes
    if previews:
        assert any(box["kind"] == "image" for node in nodes for box in node["drawn"]), nodes

    version = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ ?? 'unknown'")
    shot = Path(os.environ.get("SEGCKPT_ARTIFACTS", tmp_path)) / f"canvas-{ui_file.stem}-frontend-{version}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert not errors, errors
    page.close()
