"""The plan route the schedule node's block strip reads (served by aiohttp, as inside ComfyUI)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from segmented_checkpointing.engine.config.backends import STREAMED, TABLE
from segmented_checkpointing.engine.core.plan_query import plan_for_query, reference_block_counts
from segmented_checkpointing.nodes.routes import PLAN_ROUTE, register_routes


def _get(query: dict) -> tuple[int, dict]:
    async def go():
        routes = web.RouteTableDef()
        register_routes(routes)
        app = web.Application()
        app.add_routes(routes)
        async with TestClient(TestServer(app)) as client:
            response = await client.get(PLAN_ROUTE, params=query)
            return response.status, await response.json()
    return asyncio.run(go())


def test_plan_route_returns_the_engine_plan():
    query = {"family": "flux", "size": "tiny", "gradient_checkpointing_interval": "2",
             "gradient_checkpointing_segment_stride": "4", "gradient_checkpointing_backend": "unsloth"}
    status, plan = _get(query)
    assert status == 200
    assert plan == {**plan_for_query(query)}
    assert plan["block_map"] == {"double": "OO..OO..", "single": "OO..OO.."}
    assert plan["num_blocks"] == {"double": 8, "single": 8}
    # the strip's colour and label of each mark come with the plan, from the backend table
    assert plan["marks"]["O"] == {"color": TABLE["unsloth"].mark.color, "label": "checkpointed, inputs offloaded"}
    assert list(plan["marks"]) == list("CKOkFfa.")


def test_full_size_uses_the_class_defaults():
    # FluxTransformer2DModel's defaults are Flux.1's 19 double + 38 single blocks
    assert dict(reference_block_counts("flux", "full")) == {"double": 19, "single": 38}
    status, plan = _get({"family": "flux", "gradient_checkpointing": "false"})
    assert status == 200 and plan["block_map"]["single"] == "." * 38


@pytest.mark.parametrize("blocks", ["all", "", "3"])
def test_plan_route_shows_the_streamed_blocks(blocks):
    # what the block strip sends with a Weight Offload Options node (blocks 0 = "all")
    query = {"family": "flux", "size": "tiny", "gradient_checkpointing_interval": "2", "weight_offload": "stream",
             "weight_offload_blocks": blocks, "weight_offload_prefetch": "1"}
    status, plan = _get(query)
    assert status == 200 and plan == plan_for_query(query)
    assert set(plan["stream_map"]) == set(plan["block_map"])
    marks = "".join(plan["stream_map"].values())
    assert set(marks) <= {"S", "."} and marks.count("S") == plan["streamed_blocks"] == (3 if blocks == "3" else 16)
    assert plan["mode"] == "interval2" + ("-stream3" if blocks == "3" else "-stream")
    assert plan["stream_marks"] == {"S": {"color": STREAMED.color, "label": "frozen weights streamed",
                                          "base": plan["marks"]["."]["color"]}}
    status, plain = _get({"family": "flux", "size": "tiny"})
    assert status == 200 and plain["stream_map"] == {} and plain["streamed_blocks"] == 0


@pytest.mark.parametrize("query, text", [
    ({"family": "nope"}, "family='nope' is invalid"),
    ({}, "family='' is invalid"),
    ({"family": "flux", "size": "huge"}, "size='huge' is invalid"),
    ({"family": "flux", "path": "/etc/passwd"}, "parameter path='/etc/passwd' is unknown"),
    ({"family": "flux", "gradient_checkpointing_interval": "two"}, "gradient_checkpointing_interval='two'"),
    ({"family": "flux", "gradient_checkpointing_interval": "2", "gradient_checkpointing_segment_stride": "1"},
     "gradient_checkpointing_segment_stride=1"),
    ({"family": "flux", "gradient_checkpointing_offload_pin_memory_max_buckets": "-1"},
     "gradient_checkpointing_offload_pin_memory_max_buckets=-1"),
    ({"family": "flux", "weight_offload": "swap"}, "weight_offload='swap'"),
    ({"family": "flux", "weight_offload": "stream", "weight_offload_prefetch": "9"}, "weight_offload_prefetch=9"),
    ({"family": "flux", "weight_offload_blocks": "4"}, "weight_offload_blocks=4"),
])
def test_bad_parameters_answer_400_naming_them(query, text):
    status, body = _get(query)
    assert status == 400 and text in body["error"]


def test_repeated_parameter_is_refused():
    status, body = _get([("family", "flux"), ("family", "wan")])
    assert status == 400 and "family" in body["error"]


def test_an_unexpected_failure_answers_json_the_strip_can_show(monkeypatch):
    """Issue 34: a failed import answered aiohttp's text page, and the canvas showed a JSON SyntaxError."""
    from segmented_checkpointing.nodes import routes

    def broken(_query):
        raise RuntimeError("Failed to import diffusers.models.transformers.transformer_wan")

    monkeypatch.setattr(routes, "plan_for_query", broken)
    status, body = _get({"family": "wan"})
    assert status == 500
    assert body == {"error": "the plan could not be computed: RuntimeError: Failed to import "
                             "diffusers.models.transformers.transformer_wan"}
