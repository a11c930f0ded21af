"""Run an API-format workflow in-process with the pack's node classes (``segckpt run``).

The API format is ComfyUI's queue format: ``{node_id: {"class_type": ..., "inputs": {name: value
or [source_id, output_index]}}}``. Every node is validated first, as ComfyUI's ``/prompt`` does
(known type, required inputs present, widget values of the declared type and range, the node's
own ``validate_inputs``), then nodes run in dependency order, each once, as ComfyUI runs a V3 node
(:func:`run_node`).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from . import NODE_CLASS_MAPPINGS
from .v3 import io, overridden


class GraphError(ValueError):
    """The workflow is invalid; the message names the node id, its type and the input."""


def load_api_graph(path: str | Path) -> dict[str, dict]:
    """Read an API-format workflow file.

    Raises:
        GraphError: unreadable, not an object, or a UI-format file (which has ``nodes``/``links``).
    """
    try:
        graph = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise GraphError(f"{path}: not a readable JSON workflow ({exc})") from exc
    if not isinstance(graph, dict) or "nodes" in graph and "links" in graph:
        raise GraphError(f"{path}: not an API-format workflow (export it with 'Save (API)')")
    return graph


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _check_widget(node_id: str, kind: str, name: str, spec: Any, value: Any) -> None:
    declared, options = spec[0], (spec[1] if len(spec) > 1 else {})
    where = f"node {node_id} ({kind}) input {name}={value!r}"
    if declared == "COMBO":
        if value not in options["options"]:
            raise GraphError(f"{where} is invalid: allowed {', '.join(map(str, options['options']))}")
        return
    python_type = {"INT": int, "FLOAT": (int, float), "BOOLEAN": bool, "STRING": str}.get(declared)
    if python_type is None:
        raise GraphError(f"{where} is invalid: a {declared} input must be a link from another node")
    if not isinstance(value, python_type) or (declared in ("INT", "FLOAT") and isinstance(value, bool)):
        raise GraphError(f"{where} is invalid: allowed a {declared}")
    if "min" in options and value < options["min"] or "max" in options and value > options["max"]:
        raise GraphError(f"{where} is invalid: allowed {options.get('min')} to {options.get('max')}")


def validate(graph: dict[str, dict]) -> None:
    """Validate every node before any runs.

    Raises:
        GraphError: the first problem found, naming the node id, type and input.
    """
    foreign = {node_id: node.get("class_type") for node_id, node in graph.items()
               if node.get("class_type") not in NODE_CLASS_MAPPINGS}
    if foreign:
        named = ", ".join(f"node {k} {v!r}" for k, v in foreign.items())
        raise GraphError(f"{named}: not nodes of this pack; `segckpt run` runs graphs of this pack's nodes only "
                         f"(known: {', '.join(sorted(NODE_CLASS_MAPPINGS))}); queue a workflow that uses "
                         "ComfyUI's own nodes to a ComfyUI server")
    for node_id, node in graph.items():
        kind = node.get("class_type")
        cls = NODE_CLASS_MAPPINGS[kind]
        declared = cls.INPUT_TYPES()
        inputs = node.get("inputs", {})
        for section in ("required", "optional"):
            for name, spec in declared.get(section, {}).items():
                if name not in inputs:
                    if section == "required":
                        raise GraphError(f"node {node_id} ({kind}): required input {name} is missing")
                    continue
                value = inputs[name]
                if _is_link(value):
                    if value[0] not in graph:
                        raise GraphError(f"node {node_id} ({kind}) input {name}: links to missing node {value[0]}")
                else:
                    _check_widget(node_id, kind, name, spec, value)
        validator = overridden(cls, "validate_inputs")
        if validator is not None:
            params = inspect.signature(validator).parameters
            every = any(p.kind is p.VAR_KEYWORD for p in params.values())
            # as ComfyUI: a linked input the validator names arrives as None (its value is not known yet)
            given = {k: None if _is_link(v) else v for k, v in inputs.items() if every or k in params}
            try:
                verdict = validator(**given)
            except ValueError as exc:  # validators that report once raise (see the Schedule node)
                verdict = str(exc)
            if verdict is not True:
                raise GraphError(f"node {node_id} ({kind}): {verdict}")


def run_node(cls: type[io.ComfyNode], *args: Any, node_id: str | None = None, **inputs: Any) -> io.NodeOutput:
    """Run one node as ComfyUI runs a V3 node: ``execute(*args, **inputs)`` on a copy of the class
    whose hidden ``unique_id`` is ``node_id``.

    Returns:
        The node's output values (``[index]``, ``.result``) and what it shows (``.ui``).
    """
    return cls.PREPARE_CLASS_CLONE({io.Hidden.unique_id: node_id}).execute(*args, **inputs)


def run_graph(graph: dict[str, dict]) -> dict[str, Any]:
    """Validate, then execute every node once in dependency order.

    Returns:
        ``{node_id: outputs}``: each node's ``io.NodeOutput`` (its values by index, ``.ui``).

    Raises:
        GraphError: invalid graph or a dependency cycle.
    """
    validate(graph)
    results: dict[str, Any] = {}
    running: set[str] = set()

    def outputs(node_id: str) -> Any:
        if node_id in results:
            return results[node_id]
        if node_id in running:
            raise GraphError(f"node {node_id}: the workflow has a cycle")
        running.add(node_id)
        node = graph[node_id]
        cls = NODE_CLASS_MAPPINGS[node["class_type"]]
        kwargs = {}
        for name, value in node.get("inputs", {}).items():
            kwargs[name] = outputs(value[0])[value[1]] if _is_link(value) else value
        results[node_id] = run_node(cls, node_id=node_id, **kwargs)
        running.discard(node_id)
        return results[node_id]

    for node_id in graph:
        outputs(node_id)
    return results
