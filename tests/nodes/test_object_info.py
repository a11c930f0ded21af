"""The nodes in ComfyUI's V3 schema list what they listed as classic nodes (issue 37): every node's
``/object_info`` entry equals the one recorded from the pack before the change
(``fixtures/object_info.json``, from ComfyUI 0.3.64 with an empty base folder), apart from what V3
adds (:func:`helpers.object_info_as_v1` names it). Here the entries come from the nodes' V3
declarations rendered without ComfyUI (``nodes/v3_standin.py``); ``tests/live/`` compares ComfyUI's
own ``/object_info`` with the same fixture."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers import MEASURE_TOOLTIPS, comparable_object_info, object_info_as_v1, recorded_object_info

from segmented_checkpointing.engine import api
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes import comfy_entrypoint
from segmented_checkpointing.nodes.planning_nodes import PLAN, SWEEP
from segmented_checkpointing.nodes.v3 import io

NODE_OPTIONS = {"SegCkptSweep": SWEEP, "SegCkptSchedulePlanner": PLAN}
RECORDED = json.loads((Path(__file__).parent / "fixtures" / "object_info.json").read_text())


def test_the_extension_lists_every_node_as_a_v3_node():
    nodes = asyncio.run(asyncio.run(comfy_entrypoint()).get_node_list())
    assert sorted(cls.GET_SCHEMA().node_id for cls in nodes) == sorted(RECORDED)
    assert all(issubclass(cls, io.ComfyNode) for cls in nodes)


@pytest.mark.parametrize("kind", sorted(RECORDED))
def test_object_info_of_every_node_is_the_recorded_one(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))  # no model files: the source list is the preset only
    info = object_info_as_v1(NODES[kind].GET_NODE_INFO_V1())
    assert info.pop("python_module") is None  # set by ComfyUI when it loads the pack (compared in tests/live/)
    for node, name in MEASURE_TOOLTIPS:  # now the option's help text
        if node == kind:
            option = api.option_named(NODE_OPTIONS[kind].names[name], api.MEASURE_OPTIONS)
            assert info["input"]["required"][name][1]["tooltip"].endswith(option.help)
    assert comparable_object_info(kind, info) == recorded_object_info(kind)
