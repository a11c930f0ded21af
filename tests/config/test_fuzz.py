"""Fuzzed inputs (hypothesis, bounded): schedule keys, CLI options, config files and the nodes'
inputs as an API-format workflow carries them. Every case is accepted or refused with the
project's own error (a ValueError of ours naming the key, the value and what is allowed); no other
exception escapes, and nothing is written."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
from helpers import pack_only
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import ALIASES, OPTIONS, TrainConfig, read_config_file
from segmented_checkpointing.engine.config.schedule import KEYS, CheckpointSchedule
from segmented_checkpointing.engine.train.checks import check_run
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.graph import validate

EXAMPLES = int(os.environ.get("SEGCKPT_FUZZ_EXAMPLES", "60"))
"""Examples per property (CI: 60; set SEGCKPT_FUZZ_EXAMPLES=1000 for a deeper local run)."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# the graphs `segckpt run` validates (the closed loop also holds ComfyUI's own nodes)
WORKFLOWS = [p for p in sorted((Path(__file__).resolve().parents[2] / "workflows" / "api").glob("*.api.json"))
             if pack_only(p)]

values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.sampled_from(
        ["", "none", "NaN", "inf", "-3", "1e400", "torch", "unsloth-ffn", "üñí©ødé ✓", "x" * 5000, "../../etc",
         "/etc/passwd", "auto", "flash,math", "0x10"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def _ours(exc: BaseException) -> bool:
    """A ValueError defined by this project (ConfigError, ScheduleError, GraphError, ...)."""
    return isinstance(exc, ValueError) and type(exc).__module__.startswith("segmented_checkpointing")


def _named(exc: BaseException, key: str) -> bool:
    return key in str(exc) or key.replace("_", " ") in str(exc)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
def test_schedule_keys(keys):
    try:
        CheckpointSchedule.from_config(keys)
    except Exception as exc:  # noqa: BLE001 - the assertion is about the type
        assert _ours(exc) and any(_named(exc, k) for k in keys), repr(exc)


CONFIG_KEYS = sorted({opt.key for opt in OPTIONS} | set(ALIASES))


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), values, min_size=1, max_size=3))
def test_config_values(values_):
    try:
        config, _ = TrainConfig.from_dict(values_)
    except Exception as exc:  # noqa: BLE001
        assert _ours(exc), repr(exc)
        return
    assert isinstance(config, TrainConfig)


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_config_files(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_bytes(content)
    try:
        data = read_config_file(path)
        TrainConfig.from_dict(data)
    except Exception as exc:  # noqa: BLE001
        assert _ours(exc) and ("c.json" in str(exc) or "=" in str(exc)), repr(exc)


OPTIONS = ["--family", "--resolution", "--steps", "--batch-size", "--grad-accum", "--lr", "--lr-scheduler",
           "--lr-warmup-steps", "--weight-decay", "--seed", "--rank", "--alpha", "--lora-dropout", "--device",
           "--mixed-precision", "--base-precision", "--attention-backend", "--on-nonfinite", "--save-every",
           "--timing-warmup-steps", "--interval", "--stride", "--backend", "--pin-buckets", "--data",
           "--model-path", "--model-file", "--init-lora", "--preset"]
texts = st.one_of(st.text(max_size=30), st.sampled_from(["0", "-1", "nan", "inf", "1e99", "2.5", "none", "", "7",
                                                         "99999999999999999999", "torch", "é"]))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(OPTIONS), texts), min_size=1, max_size=3))
def test_cli_options(tmp_path_factory, pairs):
    out = tmp_path_factory.mktemp("cli") / "out"
    argv = ["train", "--output", str(out)] + [x for pair in pairs for x in pair]
    try:
        args = cli._parser().parse_args(argv)
        check_run(cli.config_from_args(args))
    except SystemExit as exc:  # argparse's own one-line usage error (a non-number for a number)
        assert exc.code == 2
    except Exception as exc:  # noqa: BLE001
        assert _ours(exc), repr(exc)
    assert not out.exists() or not any(out.rglob("*"))  # nothing written, nothing half-written


def _widget_inputs():
    """(workflow, node id, input name) of every widget value in the shipped API workflows."""
    found = []
    for path in WORKFLOWS:
        graph = json.loads(path.read_text())
        for node_id, node in graph.items():
            for name, value in node["inputs"].items():
                if not (isinstance(value, list) and len(value) == 2):
                    found.append((path.name, node_id, name))
    return found


@pytest.mark.parametrize("where", _widget_inputs(), ids=lambda w: f"{w[0].split('.')[0]}-{w[1]}-{w[2]}")
@settings(max_examples=max(1, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=values)
def test_node_inputs_in_an_api_workflow(where, value, tmp_path_factory, monkeypatch):
    base = tmp_path_factory.mktemp("comfy")
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(base))
    workflow, node_id, name = where
    graph = copy.deepcopy(json.loads(next(p for p in WORKFLOWS if p.name == workflow).read_text()))
    graph[node_id]["inputs"][name] = value
    try:
        validate(graph)
        node = graph[node_id]
        if node["class_type"] == "SegCkptTrainLoRA":  # what the node builds before any training
            NODES["SegCkptTrainLoRA"].check_inputs(**{k: v for k, v in node["inputs"].items()
                                                       if not isinstance(v, list)})
    except Exception as exc:  # noqa: BLE001
        assert _ours(exc) and (name in str(exc) or f"node {node_id}" in str(exc)), repr(exc)
    assert not any(base.rglob("*.safetensors")) and not any(base.rglob("*.tmp"))


def test_nan_and_infinite_numbers_are_refused_by_name():
    for key in ("learning_rate", "weight_decay", "lora_alpha", "lora_dropout"):
        for bad in (math.nan, math.inf):
            with pytest.raises(ValueError, match=key):
                TrainConfig.from_dict({key: bad})
