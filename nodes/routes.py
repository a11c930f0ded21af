"""HTTP route the frontend reads the schedule node's plan from: ``GET /segckpt/plan``.

Registered on ComfyUI's server (``PromptServer.instance.routes``; ComfyUI also serves it under
``/api``). It computes the engine's plan of the query (:func:`~..engine.core.plan_query.plan_for_query`) from
query parameters only: every parameter is validated, unknown ones are refused, and nothing on the
file system is read or listed.

Responses: 200 with the plan as JSON; 400 with ``{"error": message}`` naming the parameter, its
value and what is allowed.
"""

from __future__ import annotations

import asyncio

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
    return web.json_response(plan)


def register_routes(routes: web.RouteTableDef) -> None:
    """Add the pack's routes to ``routes`` (ComfyUI's ``PromptServer.instance.routes``)."""
    routes.get(PLAN_ROUTE)(plan_handler)


def register_with_comfyui() -> None:  # pragma: no cover - exercised by the live ComfyUI tests
    """Register on the running ComfyUI server, if there is one (not under ``segckpt run``)."""
    try:
        from server import PromptServer
    except ImportError:
        return
    if getattr(PromptServer, "instance", None) is not None:
        register_routes(PromptServer.instance.routes)
