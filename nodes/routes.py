"""HTTP route the frontend reads the schedule node's plan from: ``GET /segckpt/plan``.

Registered on ComfyUI's server (``PromptServer.instance.routes``; ComfyUI also serves it under
``/api``). It computes the engine's plan of the query (:func:`~..engine.core.plan_query.plan_for_query`) from
query parameters only: every parameter is validated, unknown ones are refused, and nothing on the
file system is read or listed.

Responses: 200 with the plan as JSON; 400 with ``{"error": message}`` naming the parameter, its
value and what is allowed; 500 with ``{"error": message}`` (JSON too, so the block strip shows
it) when the plan fails for another reason, its traceback in ComfyUI's log.

Also on ComfyUI's server: :func:`name_inputs_middleware`, which makes a refused prompt's errors
name the pack node's own input (see :func:`name_inputs`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Mapping

from aiohttp import web

from ..engine.api import PlanQueryError, plan_for_query

PLAN_ROUTE = "/segckpt/plan"


async def plan_handler(request: web.Request) -> web.Response:
    """``GET /segckpt/plan?family=flux&gradient_checkpointing_interval=2&...`` -> the plan JSON."""
    query = request.rel_url.query
    repeated = [key for key in set(query.keys()) if len(query.getall(key)) > 1]
    if repeated:
        return web.json_response({"error": f"parameter {repeated[0]} is given more than once: allowed once"},
                                 status=400)
    try:
        # building the reference model on the meta device can take a second: keep the loop free
        plan = await asyncio.to_thread(plan_for_query, dict(query))
    except PlanQueryError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except Exception as exc:  # a fault of ours: the strip shows its one line, the log its traceback
        logging.exception("segckpt: GET %s failed", PLAN_ROUTE)
        return web.json_response({"error": f"the plan could not be computed: {type(exc).__name__}: {exc}"},
                                 status=500)
    return web.json_response(plan)


def register_routes(routes: web.RouteTableDef) -> None:
    """Add the pack's routes to ``routes`` (ComfyUI's ``PromptServer.instance.routes``)."""
    routes.get(PLAN_ROUTE)(plan_handler)


_NAMED = re.compile(r"(?<![\w-])([a-z_][a-z0-9_]*)(=?)")
_RAISED = ("exception_during_inner_validation", "exception_during_validation")
"""ComfyUI's error types of a raised ``VALIDATE_INPUTS``: a fed node's, an output node's."""


def name_inputs(node_errors: Mapping[str, Any], classes: Mapping[str, type]) -> bool:
    """Point each validation error of a pack node at the input its message is about.

    The pack's validators raise (a returned message is listed once per input the validator takes,
    ``execution.py`` ``validate_inputs``), and ComfyUI names a raised error by no input of the node:
    a node that feeds another is validated inside the consumer's validation and its error carries
    the *consumer's* input as ``extra_info.input_name`` (``exception_during_inner_validation``: a
    Train LoRA error read ``run``, Save LoRA's input); an output node's own error carries none
    (``exception_during_validation``). The frontends label and highlight that input. The pack's
    messages name the input they are about (``run_name='/x' is invalid``): this sets ``input_name``
    to the first of the node's own inputs the message names (``name=`` first), or drops it when it
    names none, and drops the traceback (the frames of a refused value name the server's files).
    Other nodes' errors are left as they are.

    Args:
        node_errors: the ``node_errors`` of ComfyUI's ``/prompt`` answer (changed in place).
        classes: the pack's node classes by type (``NODE_CLASS_MAPPINGS``).

    Returns:
        Whether an error was changed.
    """
    changed = False
    for entry in node_errors.values():
        cls = classes.get(entry.get("class_type"))
        if cls is None:
            continue
        declared = cls.INPUT_TYPES()
        inputs = {name: spec for section in ("required", "optional") for name, spec in declared.get(section, {}).items()}
        for error in entry.get("errors", []):
            extra = error.get("extra_info")
            if error.get("type") not in _RAISED or not isinstance(extra, dict):
                continue
            named = [(m.group(2) != "=", m.start(), m.group(1)) for m in _NAMED.finditer(str(error.get("details", "")))
                     if m.group(1) in inputs]
            if named:
                name = min(named)[2]
                extra.update(input_name=name, input_config=list(inputs[name]))
            else:
                extra.pop("input_name", None)
                extra.pop("input_config", None)
            extra.pop("linked_node", None)  # the consumer's link, not this node's
            extra.pop("traceback", None)  # a refused value, not a crash: the frames name the server's files
            changed = True
    return changed


@web.middleware
async def name_inputs_middleware(request: web.Request, handler) -> web.StreamResponse:
    """ComfyUI's ``POST /prompt`` answer with :func:`name_inputs` applied to its ``node_errors``."""
    response = await handler(request)
    if (request.method != "POST" or request.path.removeprefix("/api") != "/prompt"
            or not isinstance(response, web.Response) or response.content_type != "application/json"):
        return response
    try:
        body = json.loads(response.body)
    except (TypeError, ValueError):
        return response
    from . import NODE_CLASS_MAPPINGS

    if isinstance(body, dict) and isinstance(body.get("node_errors"), dict) and name_inputs(
            body["node_errors"], NODE_CLASS_MAPPINGS):
        response.body = json.dumps(body).encode()
    return response


def register_with_comfyui() -> None:  # pragma: no cover - exercised by the live ComfyUI tests
    """Register on the running ComfyUI server, if there is one (not under ``segckpt run``): the
    plan route and :func:`name_inputs_middleware` (ComfyUI adds its routes and starts the server
    after loading the custom nodes)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    if getattr(PromptServer, "instance", None) is not None:
        register_routes(PromptServer.instance.routes)
        app = getattr(PromptServer.instance, "app", None)
        if app is not None and not app.frozen:
            app.middlewares.append(name_inputs_middleware)
