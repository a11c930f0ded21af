"""Options are declared once: the set of options is pinned, and one declaration gives the CLI flag,
the JSON key, the node widget with its range and its row of docs/OPTIONS.md; seeds take ComfyUI's full range."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import MEASURE_OPTIONS, OPTIONS, ConfigError, DataConfig, TrainConfig
from segmented_checkpointing.engine.config.options import option, options_of
from segmented_checkpointing.engine.config.table import options_page, options_table
from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.graph import validate
from segmented_checkpointing.nodes.widgets import NodeOptions, widget

ROOT = Path(__file__).resolve().parents[2]

PINNED = (
    "family", "preset", "model_path", "model_file", "vae_path", "text_encoder_path", "init_lora", "device",
    "mixed_precision", "base_model_precision", "attention_backend", "compile_blocks",
    "data", "resolution", "buckets", "num_frames", "frame_rate", "frame_sampling", "frame_buckets", "min_frames",
    "batch_size", "global_batch_size", "caption_dropout",
    "lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout", "lora_type", "use_dora", "lokr_factor",
    "lokr_full_matrix",
    "learning_rate", "lr_scheduler", "lr_warmup_steps", "weight_decay", "gradient_accumulation_steps",
    "optimizer", "max_grad_norm",
    "timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift", "loss_weighting", "snr_gamma",
    "guidance_value",
    "gradient_checkpointing", "gradient_checkpointing_backend", "gradient_checkpointing_interval",
    "gradient_checkpointing_segment_stride", "gradient_checkpointing_offload_attention",
    "gradient_checkpointing_offload_pin_memory_max_buckets", "gradient_checkpointing_save_attention",
    "weight_offload", "weight_offload_blocks", "weight_offload_prefetch",
    "memory_budget", "start_anyway", "on_oom", "watchdog_slowdown", "watchdog_window", "on_nonfinite",
    "output", "resume", "overwrite", "on_data_change", "lora_format", "save_every",
    "fsdp", "ddp", "fsdp_activation_checkpointing",
    "validation_every", "validation_prompts", "validation_num_inference_steps", "validation_frames",
    "steps", "seed", "timing_warmup_steps",
)
"""Every option of a run, in the order of the config tree: adding one is a deliberate edit here."""


MEASURE_PINNED = ("warmup_steps", "frames", "measured_steps", "attention_offload", "save_attention", "streaming",
                  "compile", "budget_gib", "budget", "host_budget", "timing_steps", "levers", "preflight", "nproc")
"""Every option of a measurement (sweep, plan, pre-flight), in the order of its config tree."""

NOT_OPTIONS = {
    ("train", "--config"), ("sweep", "--config"), ("plan", "--config"),  # the file the options are read from
    ("families", "--limits"),  # what a table of the adapters shows: no run or measurement is configured
    ("run", "workflow"), ("run", "--base-dir"),  # a workflow file and ComfyUI's folders: the nodes' inputs are in it
}
"""The flags of ``segckpt`` that are no option, each with why."""


def test_the_set_of_options_is_pinned():
    assert tuple(opt.key for opt in OPTIONS) == PINNED
    assert tuple(opt.key for opt in MEASURE_OPTIONS) == MEASURE_PINNED


def test_every_flag_of_segckpt_is_generated_from_an_option():
    """Issue 37: no hand-written flag in cli.py but the plumbing of :data:`NOT_OPTIONS`; each flag is
    an option's, its destination the option's key; sweep and plan take every measurement option of theirs."""
    declared = {opt.key: opt.cli for opt in (*OPTIONS, *MEASURE_OPTIONS)}
    commands = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    plumbing = set()
    for command, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.option_strings == [declared.get(action.dest)]:
                continue
            plumbing.add((command, action.option_strings[0] if action.option_strings else action.dest))
    assert plumbing == NOT_OPTIONS
    for command in ("sweep", "plan"):
        dests = {action.dest for action in commands[command]._actions}
        assert {opt.key for opt in MEASURE_OPTIONS if opt.path[0] in (opt.key, command)} <= dests, command
    assert [a.dest for a in commands["plan"]._actions if a.required] == ["budget"]


def test_segckpt_options_prints_the_committed_options_page(capsys):
    assert cli.main(["options"]) == 0
    printed = capsys.readouterr().out
    assert printed == options_page()
    assert printed == (ROOT / "docs" / "OPTIONS.md").read_text(), \
        "docs/OPTIONS.md is stale: regenerate with `segckpt options > docs/OPTIONS.md`"
    assert options_table() in printed  # every option of a run, one row each


@dataclass(frozen=True)
class _DataWithThrowaway(DataConfig):
    throwaway_level: int = option(3, "A throwaway option of the data (test only).", "--throwaway-level", min=1,
                                  max=9)


@dataclass(frozen=True)
class _RunWithThrowaway(TrainConfig):
    data: _DataWithThrowaway = field(default_factory=_DataWithThrowaway)


def test_one_declaration_gives_flag_json_key_widget_and_options_row():
    options = tuple(options_of(_RunWithThrowaway))
    # the CLI flag
    parser = argparse.ArgumentParser()
    cli._add_options(parser, options=options)
    args = parser.parse_args(["--throwaway-level", "5"])
    assert args.throwaway_level == 5 and "--throwaway-level" in parser.format_help()
    # the JSON key (a config file) and its validation, naming the key and what is allowed
    config, ignored = _RunWithThrowaway.from_dict({"throwaway_level": 7, "steps": 2})
    assert config.data.throwaway_level == 7 and not ignored and config.to_dict()["throwaway_level"] == 7
    with pytest.raises(ConfigError, match=r"throwaway_level=12 is invalid: allowed an integer from 1 to 9"):
        _RunWithThrowaway.create(throwaway_level=12)
    # the node widget with its range, and the node's config from its value
    level = widget("throwaway_level", options=options)
    assert (level.id, level.get_io_type(), level.as_dict()) == (
        "throwaway_level", "INT", {"tooltip": "A throwaway option of the data (test only).", "default": 3, "min": 1,
                                   "max": 9})
    node_options = NodeOptions({"level": "throwaway_level"})
    assert node_options.config({"level": 4}, _RunWithThrowaway()).data.throwaway_level == 4
    # its row of the options table (docs/OPTIONS.md), from the option tree or from its class
    assert ("| `--throwaway-level` | `throwaway_level` | 3 | an integer from 1 to 9 | A throwaway option of the data "
            "(test only). |") in options_table(options)
    assert options_table(_RunWithThrowaway) == options_table(options)
    # and the real run's options do not have it
    assert "throwaway_level" not in {opt.key for opt in OPTIONS}


def test_widgets_take_their_range_from_the_engine():
    steps = NODES["SegCkptTrainLoRA"].INPUT_TYPES()["required"]["steps"]
    assert steps == ("INT", {"tooltip": OPTIONS[PINNED.index("steps")].help, "default": 20, "min": 1, "max": 10**8})
    resolution = NODES["SegCkptImageCaptionDataset"].INPUT_TYPES()["required"]["resolution"][1]
    assert (resolution["min"], resolution["max"], resolution["step"]) == (16, 8192, 16)
    interval = NODES["SegCkptSchedule"].INPUT_TYPES()["required"]["gradient_checkpointing_interval"][1]
    assert (interval["min"], interval["max"], interval["default"]) == (0, 1024, 2)  # 0 = unset; the demo's 2
    assert NODES["SegCkptOffloadOptions"].INPUT_TYPES()["required"]["gradient_checkpointing_backend"][1]["default"] \
        == "unsloth"


def test_the_planning_nodes_widgets_are_the_measurement_options():
    """Issue 37: the Sweep and Planner nodes restate no default, range or tooltip: one declaration
    each (``engine/config/measure.py``); the node's sweep alone keeps attention offload off by default."""
    sweep = NODES["SegCkptSweep"].INPUT_TYPES()["required"]
    planner = NODES["SegCkptSchedulePlanner"].INPUT_TYPES()["required"]
    by_key = dict(zip(MEASURE_PINNED, MEASURE_OPTIONS))
    for inputs, name, key in [(sweep, "warmup_steps", "warmup_steps"), (sweep, "measured_steps", "measured_steps"),
                              (sweep, "attention_offload_modes", "attention_offload"), (sweep, "budget_gib", "budget_gib"),
                              (planner, "warmup_steps", "warmup_steps"), (planner, "measured_steps", "timing_steps")]:
        opt = by_key[key]
        spec = inputs[name][1]
        default = False if name == "attention_offload_modes" else opt.default
        assert spec["tooltip"].endswith(opt.help) and spec["default"] == default, name
        if opt.type is not bool:
            assert (spec["min"], spec["max"]) == opt.bounds, name
    assert planner["measured_steps"][1]["default"] == 3 and by_key["attention_offload"].default is True
    assert planner["budget_gib"][1] | {"tooltip": ""} == {"tooltip": "", "default": 0.0, "min": 0.0, "max": 4096.0,
                                                          "step": 0.0001}


SEED_MAX = 2**64 - 1  # ComfyUI's seed widgets (KSampler's noise seed) give 0 .. 0xffffffffffffffff


@pytest.mark.parametrize("node", ["SegCkptLoadDiffusionModel", "SegCkptTrainLoRA"])
def test_seed_widgets_take_comfyuis_full_range(node):
    assert NODES[node].INPUT_TYPES()["required"]["seed"][1] | {"tooltip": ""} == {
        "tooltip": "", "default": 0, "min": 0, "max": SEED_MAX}


def test_the_engine_takes_every_seed_comfyui_gives(tmp_path):
    assert TrainConfig.create(seed=SEED_MAX).seed == SEED_MAX
    with pytest.raises(ConfigError, match=r"seed=18446744073709551616 is invalid: allowed an integer from 0 to 2\*\*64-1"):
        TrainConfig.create(seed=SEED_MAX + 1)
    # derived seeds (the noise generator's seed + 1, an epoch's seed + e) wrap around
    assert cli.main(["train", "--seed", str(SEED_MAX), "--steps", "1", "--resolution", "32", "--rank", "2",
                     "--output", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "report.json").read_text())["config"]["seed"] == SEED_MAX


def test_a_workflow_with_a_64_bit_seed_is_accepted():
    graph = json.loads((ROOT / "workflows" / "api" / "train_segmented_lora.api.json").read_text())
    graph["5"]["inputs"]["seed"] = 4294967296
    graph["1"]["inputs"]["seed"] = SEED_MAX
    validate(graph)
    graph["5"]["inputs"]["seed"] = SEED_MAX + 1
    with pytest.raises(ValueError, match="seed"):
        validate(graph)


@pytest.mark.parametrize("changes, message", [
    ({"lora_type": "lokr", "use_dora": True}, r"^use_dora=True is invalid with lora_type='lokr': allowed false"),
    ({"lora_type": "loha", "lora_dropout": 0.1}, r"^lora_dropout=0.1 is invalid with lora_type='loha': allowed 0"),
    ({"lora_target_modules": ["all-linear", "to_q"]},
     r"^lora_target_modules=\['all-linear', 'to_q'\] is invalid: the preset 'all-linear' stands alone"),
    ({"lora_type": "oft"}, r"^lora_type='oft' is invalid: allowed lora, lokr, loha\.$"),
    ({"model_file": "m.gguf", "lora_type": "lokr"}, r"^lora_type='lokr' is invalid with a GGUF model_file \('m.gguf'\)"),
    ({"model_file": "m.gguf", "use_dora": True}, r"^use_dora=True is invalid with a GGUF model_file \('m.gguf'\): "
                                                 r"allowed false"),
])
def test_adapter_options_that_cannot_run_are_refused_by_name(changes, message):
    """Issue 35: peft's LoKr and LoHa have no DoRA and no input dropout; a preset stands alone; a GGUF
    weight stays quantized, and LoKr, LoHa and DoRA read the base weight whole."""
    with pytest.raises(ValueError, match=message):
        TrainConfig.create(**changes)


def test_target_presets_and_simpletuner_standard():
    assert TrainConfig.create(lora_target_modules="attention").lora.target_modules is None  # the default
    assert TrainConfig.create(lora_target_modules="all-linear").lora.target_modules == ("all-linear",)
    assert TrainConfig.create(lora_type="standard").lora.lora_type == "lora"  # SimpleTuner's plain LoRA
