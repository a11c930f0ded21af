"""Weight Offload Options: its widgets come from the engine's option metadata, its validation is the
engine's, and Train LoRA runs the schedule it streams (after the activation offload override)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import verdict

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.config.schedule import STREAM_KEYS, CheckpointSchedule
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes import environment
from segmented_checkpointing.nodes.graph import run_graph
from segmented_checkpointing.nodes.payloads import WEIGHT_OFFLOAD, FamilySchedule, WeightOffload
from segmented_checkpointing.nodes.training_nodes import run_config

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NODE = NODES["SegCkptWeightOffload"]
WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "api" / "train_with_offload.api.json"


def test_the_node_is_registered_with_its_socket_and_title():
    info = NODE.GET_NODE_INFO_V1()
    assert info["display_name"] == "Weight Offload Options (stream frozen weights)"
    assert info["output"] == [WEIGHT_OFFLOAD] == ["SEGCKPT_WEIGHT_OFFLOAD"]
    assert NODES["SegCkptTrainLoRA"].INPUT_TYPES()["optional"]["weight_offload"][0] == WEIGHT_OFFLOAD


def test_widgets_come_from_the_option_metadata():
    required = NODE.INPUT_TYPES()["required"]
    assert tuple(required) == STREAM_KEYS
    mode, blocks, prefetch = (api.option_named(key, api.OPTIONS) for key in STREAM_KEYS)
    kind, spec = required["weight_offload"]
    assert kind == "COMBO" and spec["options"] == list(mode.choices) == ["none", "stream"]
    assert spec["default"] == "stream" != mode.default  # connecting the node means streaming
    assert spec["tooltip"] == mode.help
    kind, spec = required["weight_offload_blocks"]
    assert kind == "INT" and (spec["min"], spec["max"], spec["default"]) == (0, blocks.bounds[1], 0)  # 0 = all
    assert spec["tooltip"] == blocks.help + " 0 = all."
    kind, spec = required["weight_offload_prefetch"]
    assert kind == "INT" and (spec["min"], spec["max"], spec["default"]) == (*prefetch.bounds, prefetch.default)
    assert spec["tooltip"] == prefetch.help


@pytest.mark.parametrize("inputs, text", [
    ({"weight_offload": "swap"}, "weight_offload='swap'"),
    ({"weight_offload_prefetch": 9}, "weight_offload_prefetch=9"),
    ({"weight_offload_blocks": 2000}, "weight_offload_blocks=2000"),
    ({"weight_offload": "none", "weight_offload_blocks": 4}, "weight_offload_blocks=4"),
])
def test_validation_refuses_an_invalid_value_naming_the_key(inputs, text):
    found = verdict(NODE, **{"weight_offload": "stream", "weight_offload_blocks": 0, "weight_offload_prefetch": 1,
                             **inputs})
    assert found is not True and text in found


def test_validation_takes_the_defaults_and_linked_inputs():
    defaults = {key: spec[1]["default"] for key, spec in NODE.INPUT_TYPES()["required"].items()}
    assert NODE.validate_inputs(**defaults) is True
    assert NODE.validate_inputs(**{**defaults, "weight_offload_blocks": None}) is True  # linked: not known yet


def test_build_reads_blocks_0_as_all_and_applies_over_a_schedule():
    (payload,) = NODE.execute(weight_offload="stream", weight_offload_blocks=0, weight_offload_prefetch=2)
    assert payload == WeightOffload("stream", None, 2)
    schedule = payload.apply(CheckpointSchedule(gradient_checkpointing_interval=2))
    assert schedule.streams and schedule.weight_offload_blocks is None and schedule.weight_offload_prefetch == 2
    assert schedule.gradient_checkpointing_interval == 2 and schedule.mode == "interval2-stream-p2"
    (eight,) = NODE.execute(weight_offload="stream", weight_offload_blocks=8, weight_offload_prefetch=1)
    assert eight.apply(CheckpointSchedule()).weight_offload_blocks == 8


def test_train_lora_applies_it_after_the_activation_offload_options():
    (offload,) = NODES["SegCkptOffloadOptions"].execute(
        gradient_checkpointing_backend="unsloth", gradient_checkpointing_offload_attention=True,
        gradient_checkpointing_offload_pin_memory_max_buckets=4)
    (weights,) = NODE.execute(weight_offload="stream", weight_offload_blocks=3, weight_offload_prefetch=0)
    schedule = FamilySchedule("flux", CheckpointSchedule(gradient_checkpointing_interval=2))
    config = run_config({"offload": offload, "weight_offload": weights}, schedule=schedule, find_run=False)
    assert config.schedule.gradient_checkpointing_backend == "unsloth"  # the offload node's
    assert (config.schedule.weight_offload, config.schedule.weight_offload_blocks,
            config.schedule.weight_offload_prefetch) == ("stream", 3, 0)
    assert config.schedule.mode == "interval2-unsloth-offload-attn-stream3-p0"
    assert not run_config({"offload": offload}, schedule=schedule, find_run=False).schedule.streams


def test_a_graph_with_the_node_trains_a_streaming_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    local = environment.local_host  # a host that unloads its own models first, as ComfyUI's does (issue 36)
    monkeypatch.setattr(environment, "local_host", lambda base: dataclasses.replace(
        local(base), release_models=lambda: ["ComfyUI unloaded 1 model(s) before training: Flux (12 GiB)"]))
    graph = json.loads(WORKFLOW.read_text())
    graph["9"] = {"class_type": "SegCkptWeightOffload",
                  "inputs": {"weight_offload": "stream", "weight_offload_blocks": 0, "weight_offload_prefetch": 1}}
    graph["5"]["inputs"].update(steps=1, weight_offload=["9", 0])
    graph["2"]["inputs"]["resolution"] = 64
    run = run_graph(graph)["5"][0]
    assert run.config.schedule.streams and run.config.schedule.weight_offload_blocks is None
    assert run.config.schedule.gradient_checkpointing_backend == "unsloth"  # the offload node's still applies
    plan = run.plan.to_dict()
    assert plan["stream_map"] == {"double": "S" * 8, "single": "S" * 8}  # the tiny preset's 8 + 8 blocks, all
    assert plan["streamed_blocks"] == 16
    assert run.plan.mode.endswith("-stream")
    log = capsys.readouterr().out
    assert log.index("ComfyUI unloaded 1 model(s) before training: Flux (12 GiB)") < log.index("plan (flux")
    memory = run.report["memory"]
    assert memory["device_free_bytes_at_start"] is None and memory["host_arena"]["chunks"] >= 1  # CPU: no CUDA figure
