"""Write the UI-format (drag-and-drop) workflows from their API-format twins.

``workflows/api/<name>.api.json`` holds the values (the source of truth), ``workflows/layout/<name>.json``
the layout (which nodes stand in which column, the groups, sizes asked for, titles, the view, the
workflow's id). For each pair this writes ``workflows/<name>.json`` and rewrites the API file in one
formatting, its nodes' inputs in declared order and a declared widget that the file lacks at the
widget's default. Node positions come from node sizes measured on the real frontends
(``workflows/measured/node_sizes.json``, see :func:`lay_out`), so no node covers another.

    python workflows/make_ui.py            # rewrite the files that differ
    python workflows/make_ui.py --check    # list them and exit 1 (nothing written)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any, NamedTuple

FOLDER = Path(__file__).resolve().parent
WIDGET_TYPES = ("COMBO", "INT", "FLOAT", "BOOLEAN", "STRING")
TYPE_DEFAULTS = {"INT": 0, "FLOAT": 0.0, "BOOLEAN": False, "STRING": ""}  # the frontend's, when none is declared
OPTIONAL_SHAPE = 7  # litegraph's RenderShape.HOLLOW: how the frontend draws an optional input
SIZES = FOLDER / "measured" / "node_sizes.json"
TITLE = 30  # litegraph's NODE_TITLE_HEIGHT: a node's title bar, drawn above its pos
GAP = (40, 30)  # pixels between two columns; between a node's reserved bottom and the next node's title bar (and its badge)
GROUP_PAD, GROUP_HEADER = 10, 56  # a group's margin around its nodes; its title band above them
ORIGIN = (20, 20)  # the top left corner of the first column (or group)
# What a run adds below a node (pixels; its results, web/*.js), reserved under it in its column:
# the schedule strip of a family with more block lists than the measured ones, the result text
# past the size the sidecar asks for, the loss image.
RUN_RESERVE = {"SegCkptSchedule": 40, "SegCkptRunReport": 60, "SegCkptSchedulePlanner": 40, "SegCkptSaveLoRA": 40,
               "SegCkptSweep": 60, "SegCkptLossGraph": 200}
TRAIN_PREVIEWS = 16 + 92 + 6  # Train LoRA's previews: label, a row of squares, gap (TRAIN_PANEL, web/segckpt_common.js)
TRAIN_NOTES = 6 * 14  # its guardrail lines with Fit Guardrails (a verdict of two buckets, a switch)
UPLOAD = {"localized_name": "choose file to upload", "name": "upload", "type": "IMAGEUPLOAD",
          "widget": {"name": "upload"}, "link": None}  # the frontend-only button after an image_upload combo

# ComfyUI's own nodes in the shipped workflows (ComfyUI is not importable here): inputs in INPUT_TYPES order as
# (name, type[, default[, options]]), no default for a socket or where none is known (a file list), "?" before
# an optional input's name; then the output types (ComfyUI names these outputs by their types).
CORE_NODES = {
    "UNETLoader": ([("unet_name", "COMBO"), ("weight_dtype", "COMBO", "default")], ["MODEL"]),
    "CLIPLoader": ([("clip_name", "COMBO"), ("type", "COMBO", "stable_diffusion"), ("?device", "COMBO", "default")],
                   ["CLIP"]),
    "DualCLIPLoader": ([("clip_name1", "COMBO"), ("clip_name2", "COMBO"), ("type", "COMBO", "sdxl"),
                        ("?device", "COMBO", "default")], ["CLIP"]),
    "FluxGuidance": ([("conditioning", "CONDITIONING"), ("guidance", "FLOAT", 3.5)], ["CONDITIONING"]),
    "EmptyHunyuanLatentVideo": ([("width", "INT", 848), ("height", "INT", 480), ("length", "INT", 25),
                                 ("batch_size", "INT", 1)], ["LATENT"]),
    "VAELoader": ([("vae_name", "COMBO")], ["VAE"]),
    "LoadImage": ([("image", "COMBO", None, {"image_upload": True})], ["IMAGE", "MASK"]),
    "ImageScale": ([("image", "IMAGE"), ("upscale_method", "COMBO", "nearest-exact"), ("width", "INT", 512),
                    ("height", "INT", 512), ("crop", "COMBO", "disabled")], ["IMAGE"]),
    "ImageBatch": ([("image1", "IMAGE"), ("image2", "IMAGE")], ["IMAGE"]),
    "VAEEncode": ([("pixels", "IMAGE"), ("vae", "VAE")], ["LATENT"]),
    "LatentBatch": ([("samples1", "LATENT"), ("samples2", "LATENT")], ["LATENT"]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], ["IMAGE"]),
    "ConditioningCombine": ([("conditioning_1", "CONDITIONING"), ("conditioning_2", "CONDITIONING")], ["CONDITIONING"]),
    "CLIPTextEncode": ([("text", "STRING", "", {"multiline": True}), ("clip", "CLIP")], ["CONDITIONING"]),
    "LoraLoaderModelOnly": ([("model", "MODEL"), ("lora_name", "COMBO"), ("strength_model", "FLOAT", 1.0)], ["MODEL"]),
    "EmptySD3LatentImage": ([("width", "INT", 1024), ("height", "INT", 1024), ("batch_size", "INT", 1)], ["LATENT"]),
    "KSampler": ([("model", "MODEL"), ("seed", "INT", 0, {"control_after_generate": True}), ("steps", "INT", 20),
                  ("cfg", "FLOAT", 8.0), ("sampler_name", "COMBO", "euler"), ("scheduler", "COMBO"),
                  ("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent_image", "LATENT"),
                  ("denoise", "FLOAT", 1.0)], ["LATENT"]),
    "SaveImage": ([("images", "IMAGE"), ("filename_prefix", "STRING", "ComfyUI")], []),
}


class Input(NamedTuple):
    """One declared input of a node type, as the frontend makes it."""

    name: str
    type: str  # COMBO for a list of choices
    optional: bool
    widget: bool  # a widget (with a socket beside it), else a socket only
    control: bool  # a control_after_generate widget follows it
    upload: bool  # an upload button follows it
    default: Any  # the widget's value when none is given; None: none known


def _pack_nodes() -> dict:
    """The pack's ``NODE_CLASS_MAPPINGS``, from this checkout when the package is not importable from it."""
    name, root = "segmented_checkpointing", FOLDER.parent
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != root:
            spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.nodes").NODE_CLASS_MAPPINGS


def _spec(kind: str) -> tuple[dict, list[tuple[str, str]]]:
    """A node type's ``INPUT_TYPES()`` and outputs ``(name, type)``: read from our classes, or ``CORE_NODES``."""
    if kind not in CORE_NODES:
        info = _pack_nodes()[kind].GET_NODE_INFO_V1()  # what /object_info lists
        return info["input"], list(zip(info["output_name"], info["output"]))
    inputs, outputs = CORE_NODES[kind]
    spec = {"required": {}, "optional": {}}
    for name, type_, *rest in inputs:
        options = {"default": rest[0]} if rest and rest[0] is not None else {}
        options.update(*rest[1:])
        spec["optional" if name.startswith("?") else "required"][name.lstrip("?")] = (type_, options)
    return spec, [(type_, type_) for type_ in outputs]


def declared(kind: str) -> tuple[list[Input], list[tuple[str, str]]]:
    """A node type's inputs (required then optional, each in declared order) and outputs ``(name, type)``.

    Raises:
        KeyError: neither one of the pack's node types nor in ``CORE_NODES``.
    """
    spec, outputs = _spec(kind)
    inputs = []
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            options = entry[1] if len(entry) > 1 else {}
            choices = entry[0] if isinstance(entry[0], list) else options.get("options", [])  # V1 or V3 combo
            type_ = "COMBO" if choices else entry[0]
            control = type_ == "INT" and (name in ("seed", "noise_seed") or bool(options.get("control_after_generate")))
            default = options.get("default", choices[0] if choices else TYPE_DEFAULTS.get(type_))
            inputs.append(Input(name, type_, section == "optional", type_ in WIDGET_TYPES and not options.get("forceInput"),
                                control, bool(options.get("image_upload")), default))
    return inputs, outputs


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def normalise(api: dict) -> dict:
    """The API graph in node-id order, inputs in declared order, a missing widget at its default.

    Raises:
        ValueError: an input its node does not declare, or a missing widget with no default known.
    """
    graph = {}
    for node_id in sorted(api, key=int):
        node, values = api[node_id], {}
        for i in declared(node["class_type"])[0]:
            if i.name in node["inputs"]:
                values[i.name] = node["inputs"][i.name]
            elif i.widget:
                if i.default is None:
                    raise ValueError(f"node {node_id} ({node['class_type']}): give {i.name} (no default known)")
                values[i.name] = i.default
        if set(node["inputs"]) - set(values):
            raise ValueError(f"node {node_id} ({node['class_type']}): undeclared {sorted(set(node['inputs']) - set(values))}")
        graph[node_id] = {**node, "inputs": values}
    return graph


def _slots(inputs: list[Input]) -> list[dict]:
    """A node's input slots as the frontend makes them: its sockets, then one per widget."""
    slots = []
    for i in [i for i in inputs if not i.widget] + [i for i in inputs if i.widget]:
        slots.append({"localized_name": i.name, "name": i.name, **({"shape": OPTIONAL_SHAPE} if i.optional else {}),
                      "type": i.type, **({"widget": {"name": i.name}} if i.widget else {}), "link": None})
        if i.upload:
            slots.append({**UPLOAD, "widget": dict(UPLOAD["widget"])})
    return slots


def _widgets(inputs: list[Input], values: dict, shown: dict) -> list[tuple[str, Any]]:
    """The node's widgets ``(name, value)`` in the frontend's order; a linked one shows ``shown`` or its default."""
    widgets = []
    for i in (i for i in inputs if i.widget):
        value = shown.get(i.name, i.default) if _is_link(values[i.name]) else values[i.name]
        widgets.append((i.name, int(value) if isinstance(value, float) and value.is_integer() else value))  # as JS
        if i.control:
            widgets.append(("control_after_generate", "fixed"))  # reproducible: never re-seeded on queue
        if i.upload:
            widgets.append(("upload", i.name))
    return widgets


def _execution_order(ids: list[int], links: list[list]) -> dict[int, int]:
    """Litegraph's execution order (Kahn's algorithm in node-id, output-slot, link-id order): id -> order.

    Raises:
        ValueError: the graph has a cycle.
    """
    waiting = dict.fromkeys(ids, 0)
    for link in links:
        waiting[link[3]] += 1
    queue, order = [n for n in ids if not waiting[n]], []
    while queue:
        order.append(queue.pop(0))
        for link in sorted((link for link in links if link[1] == order[-1]), key=lambda link: (link[2], link[0])):
            waiting[link[3]] -= 1
            if not waiting[link[3]]:
                queue.append(link[3])
    if len(order) != len(ids):
        raise ValueError(f"the graph has a cycle through nodes {sorted(set(ids) - set(order))}")
    return {node: index for index, node in enumerate(order)}


def node_sizes(path: Path = SIZES) -> dict[str, list[float]]:
    """Each node type's smallest size ``[width, height]`` in pixels (its ``computeSize`` on ComfyUI
    frontends 1.27 and 1.58, the larger of the two), as ``tests/live/test_comfyui_browser.py``
    measured it with ``SEGCKPT_MEASURE_NODE_SIZES=1``."""
    return json.loads(path.read_text(encoding="utf-8"))["sizes"]


def run_reserve(kind: str, inputs: dict, guarded: bool) -> float:
    """Pixels a run adds below a node of type ``kind`` (its results) with API ``inputs``;
    ``guarded``: the workflow has Fit Guardrails (Train LoRA then shows its lines)."""
    if kind == "SegCkptTrainLoRA":
        return (TRAIN_PREVIEWS if inputs.get("preview_every") else 0) + (TRAIN_NOTES if guarded else 0)
    return RUN_RESERVE.get(kind, 0)


def _node_size(kind: str, asked: list | None, sizes: dict) -> list[float]:
    if kind not in sizes:
        raise ValueError(f"no measured size for node type {kind}: run tests/live/test_comfyui_browser.py with "
                         f"SEGCKPT_MEASURE_NODE_SIZES=1 on both frontends (it writes {SIZES.name})")
    return [max(a, m) for a, m in zip(asked or (0, 0), sizes[kind])]


def lay_out(api: dict, layout: dict, sizes: dict) -> tuple[dict[str, dict], list[dict]]:
    """Node positions and sizes, and group boxes, from the sidecar's columns.

    The sidecar's ``rows`` (or ``columns``: one row of one block) are laid out top to bottom; a row's
    blocks (a group when it has a ``title`` and ``color``) left to right; a block's ``columns`` left to
    right, each as wide as its widest node; a column's nodes (API ids) top to bottom, each at the larger
    of the size its sidecar entry asks for and its type's measured size (:func:`node_sizes`), with
    :func:`run_reserve` pixels free below it. No two nodes' boxes (title bar and reserve included) overlap.

    Returns:
        ``({node_id: {"pos", "size"}}, [{"title", "color", "bounding"}])``, pixels.

    Raises:
        ValueError: a node in no column or in two, a column naming no node, a type without measured size.
    """
    rows = layout.get("rows") or [[{"columns": layout["columns"]}]]
    listed = [node_id for row in rows for block in row for column in block["columns"] for node_id in column]
    if sorted(listed) != sorted(api):
        raise ValueError(f"nodes in no column: {sorted(set(api) - set(listed))}; in two: "
                         f"{sorted({n for n in listed if listed.count(n) > 1})}; not nodes: {sorted(set(listed) - set(api))}")
    guarded = any(node["class_type"] == "SegCkptFitGuardrails" for node in api.values())
    asked = layout.get("nodes", {})
    placed, groups, top = {}, [], ORIGIN[1]
    for row in rows:
        left, bottom = ORIGIN[0], top
        for block in row:
            pad = (GROUP_PAD, GROUP_HEADER) if "title" in block else (0, 0)
            x = right = left + pad[0]
            lowest = top
            for column in block["columns"]:
                y, width = top + pad[1], 0
                for node_id in column:
                    kind = api[node_id]["class_type"]
                    size = _node_size(kind, asked.get(node_id, {}).get("size"), sizes)
                    placed[node_id] = {"pos": [x, y + TITLE], "size": size}
                    y += TITLE + size[1] + run_reserve(kind, api[node_id]["inputs"], guarded)
                    lowest, width = max(lowest, y), max(width, size[0])
                    y += GAP[1]
                right = x + width
                x = right + GAP[0]
            if "title" in block:
                right, lowest = right + pad[0], lowest + pad[0]
                groups.append({"title": block["title"], "color": block["color"],
                               "bounding": [left, top, right - left, lowest - top]})
            left, bottom = right + GAP[0], max(bottom, lowest)
        top = bottom + GAP[1]
    return placed, groups


def make_ui(api: dict, layout: dict, sizes: dict | None = None) -> dict:
    """The UI-format workflow of a normalised API graph, laid out by its layout sidecar (:func:`lay_out`)
    with ``sizes`` (default: :func:`node_sizes`).

    Link ids count the linked input slots in node-id, then slot order.

    Raises:
        ValueError: a node without layout (or layout without node), a link to a missing output, a cycle.
    """
    extra = sorted(set(layout.get("nodes", {})) - set(api))
    if extra:
        raise ValueError(f"layout without node: {extra}")
    placed, group_boxes = lay_out(api, layout, node_sizes() if sizes is None else sizes)
    ids, nodes, links, outputs = sorted(int(k) for k in api), {}, [], {}
    for node_id in ids:
        node, where = api[str(node_id)], {**layout.get("nodes", {}).get(str(node_id), {}), **placed[str(node_id)]}
        inputs, outputs[node_id] = declared(node["class_type"])
        slots = _slots(inputs)
        for index, slot in enumerate(slots):
            value = node["inputs"].get(slot["name"])
            if _is_link(value):
                links.append([len(links) + 1, int(value[0]), value[1], node_id, index, slot["type"]])
                slot["link"] = len(links)
        nodes[node_id] = {"id": node_id, "type": node["class_type"], "pos": where["pos"], "size": where["size"],
                          "flags": where.get("flags", {}), "order": None, "mode": 0, "inputs": slots, "outputs": [],
                          **({"title": where["title"]} if "title" in where else {}),
                          "properties": {"Node name for S&R": node["class_type"]}}
        widgets = _widgets(inputs, node["inputs"], where.get("linked_widget_values", {}))
        if widgets:
            nodes[node_id].update(widgets_values=[value for _, value in widgets], widgets_values_named=dict(widgets))
    for link in links:
        if link[2] >= len(outputs.get(link[1], [])):
            raise ValueError(f"node {link[3]}: input slot {link[4]} links to a missing output {link[1:3]}")
    order = _execution_order(ids, links)
    for node_id, node in nodes.items():
        node["order"] = order[node_id]
        node["outputs"] = [{"localized_name": name, "name": name, "type": type_,
                            "links": [link[0] for link in links if link[1:3] == [node_id, slot]] or None}
                           for slot, (name, type_) in enumerate(outputs[node_id])]
    groups = [{"id": index, "title": g["title"], "bounding": g["bounding"], "color": g["color"],
               "font_size": g.get("font_size", 24), "flags": g.get("flags", {})}
              for index, g in enumerate(group_boxes, 1)]
    return {**({"id": layout["id"]} if "id" in layout else {}), "revision": 0, "last_node_id": max(ids, default=0),
            "last_link_id": len(links), "nodes": list(nodes.values()), "links": links, "groups": groups, "config": {},
            "extra": {"ds": layout.get("ds", {"scale": 1, "offset": [0, 0]})}, "version": 0.4}


def api_text(api: dict) -> str:
    """An API graph as this script writes it: nodes and their inputs one a line, each value compact."""

    def dumps(value: Any, depth: int) -> str:
        if not isinstance(value, dict) or not value or depth == 3:
            return json.dumps(value, ensure_ascii=False)
        pad = "  " * (depth + 1)
        items = (f"{pad}{json.dumps(key, ensure_ascii=False)}: {dumps(item, depth + 1)}" for key, item in value.items())
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"

    return dumps(api, 0) + "\n"


def generate(folder: Path = FOLDER) -> dict[Path, str]:
    """Every API and UI file's text as this script writes it, by path (nothing is written)."""
    texts = {}
    for api_path in sorted((folder / "api").glob("*.api.json")):
        name = api_path.name[: -len(".api.json")]
        api = normalise(json.loads(api_path.read_text(encoding="utf-8")))
        layout = json.loads((folder / "layout" / f"{name}.json").read_text(encoding="utf-8"))
        texts[api_path] = api_text(api)
        texts[folder / f"{name}.json"] = json.dumps(make_ui(api, layout), indent=1, ensure_ascii=False) + "\n"
    return texts


def main(argv: list[str] | None = None) -> int:
    """Rewrite (with ``--check``: only list) the files that differ from what :func:`generate` makes.

    Returns:
        1 with ``--check`` when a file differs, else 0.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list the files that differ; exit 1 if any (write none)")
    args = parser.parse_args(argv)
    for name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):  # not ours
        logging.getLogger(name).setLevel(logging.ERROR)
    stale = [(path, text) for path, text in generate().items()
             if not path.exists() or path.read_text(encoding="utf-8") != text]
    for path, text in stale:
        if not args.check:
            path.write_text(text, encoding="utf-8")
        print(path.relative_to(FOLDER.parent))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
