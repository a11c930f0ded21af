"""What a ComfyUI user reads: every refused value names the node's own input (in the message and
in ComfyUI's ``input_name``), the engine's command-line flags read as the nodes' inputs, and no
error type or message holds a server path."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS as NODES
from segmented_checkpointing.nodes.environment import local_host
from segmented_checkpointing.nodes.messages import node_words
from segmented_checkpointing.nodes.routes import name_inputs, name_inputs_middleware

ROOT = Path(__file__).resolve().parents[2]
SOCKETS = {"dataset": None}  # a linked input reaches validate_inputs as None (Train LoRA's data)


def _widgets(cls) -> dict[str, tuple]:
    declared = cls.INPUT_TYPES()
    return {name: spec for section in ("required", "optional") for name, spec in declared.get(section, {}).items()
            if spec[0] in ("COMBO", "INT", "FLOAT", "BOOLEAN", "STRING")}


def _default(spec) -> object:
    kind, options = spec[0], spec[1] if len(spec) > 1 else {}
    return options.get("default", options["options"][0] if kind == "COMBO" else None)


def _bad(name: str, spec) -> object:
    """A value the engine refuses for a widget: below its minimum, not a choice, not a switch, a path."""
    kind, options = spec[0], spec[1] if len(spec) > 1 else {}
    if kind == "COMBO":
        return "nope"
    if kind in ("INT", "FLOAT"):
        return options["min"] - 1 if "min" in options else options["max"] + 1
    if kind == "BOOLEAN":
        return "maybe"
    return "/abs/x" if name == "run_name" else "nope"


def _refused(cls, inputs) -> str:
    try:
        verdict = cls.validate_inputs(**inputs)
    except ValueError as exc:
        return str(exc)
    assert verdict is not True, inputs
    return verdict


def _inner_error(kind: str, message: str) -> dict:
    """ComfyUI's node_errors entry for a node fed into another whose validation raised."""
    return {"1": {"class_type": kind, "dependent_outputs": ["9"], "errors": [{
        "type": "exception_during_inner_validation", "message": "Exception when validating inner node",
        "details": message, "extra_info": {"input_name": "run", "exception_message": message,
                                           "traceback": ["  File \"/srv/comfyui/execution.py\", line 808\n"],
                                           "exception_type": "segmented_checkpointing.nodes.environment.NodeError",
                                           "linked_node": ["1", 0]}}]}}


def comfyui_errors(kind: str, inputs: dict) -> list[dict]:
    """The errors a ComfyUI 0.3.64 server lists for a pack node at ``/prompt``, from its
    ``validate_inputs`` answer (``execution.py``, ``validate_inputs``), after the pack's middleware
    (:func:`name_inputs`).

    ComfyUI gives the validator the inputs its signature names (all of them with ``**kwargs``). A
    returned message becomes one error per input given; a raised one becomes one error: under the
    node it feeds (``exception_during_inner_validation``, named by the consumer's input), or an
    output node's own (``exception_during_validation``, named by no input).
    """
    cls = NODES[kind]
    spec = inspect.getfullargspec(cls.validate_inputs)
    given = {name: value for name, value in inputs.items() if spec.varkw or name in spec.args}
    try:
        answer = cls.validate_inputs(**given)
    except Exception as exc:
        extra = {"exception_message": str(exc), "exception_type": type(exc).__name__,
                 "traceback": ["  File \"/srv/comfyui/execution.py\", line 808\n"]}
        if cls.GET_SCHEMA().is_output_node:
            errors = [{"type": "exception_during_validation", "details": str(exc), "extra_info": extra}]
        else:
            errors = [{"type": "exception_during_inner_validation", "details": str(exc),
                       "extra_info": {**extra, "input_name": "consumer", "linked_node": ["1", 0]}}]
    else:
        if answer is True:
            return []
        errors = [{"type": "custom_validation_failed", "details": name if answer is False else f"{name} - {answer}",
                   "extra_info": {"input_name": name}} for name in given]
    name_inputs({"1": {"class_type": kind, "errors": errors}}, NODES)
    return errors


def _defaults(kind: str) -> dict:
    """A node's widget values as the page sends them (every widget at its default; linked inputs None)."""
    inputs = {name: _default(spec) for name, spec in _widgets(NODES[kind]).items()}
    return {**inputs, **(SOCKETS if kind == "SegCkptTrainLoRA" else {})}


@pytest.mark.parametrize("kind, changes, input_name, text", [
    ("SegCkptImageCaptionDataset", {"folder": "missing"}, "folder",
     "folder='missing' is invalid: no such folder under the input folder"),
    ("SegCkptImageCaptionDataset", {"folder": "../x"}, "folder", "folder='../x' is invalid: allowed a relative name"),
    ("SegCkptImageCaptionDataset", {"resolution": 17}, "resolution", "resolution=17 is invalid"),
    ("SegCkptLoadDiffusionModel", {"source": "diffusion_models/missing.safetensors"}, "source",
     "source='diffusion_models/missing.safetensors' is invalid: no such .safetensors or .gguf file under "),
    ("SegCkptSaveLoRA", {"filename_prefix": "../../x"}, "filename_prefix", "filename_prefix='../../x' is invalid"),
    ("SegCkptTrainLoRA", {"run_name": "../up"}, "run_name", "run_name='../up' is invalid"),
    ("SegCkptSweep", {"run_name": "../up"}, "run_name", "run_name='../up' is invalid"),
    ("SegCkptSchedulePlanner", {"run_name": "/abs"}, "run_name", "run_name='/abs' is invalid"),
])
def test_one_cause_is_one_error_on_the_input_that_holds_it(kind, changes, input_name, text, tmp_path, monkeypatch):
    """A missing data folder was listed once per Dataset widget (8 errors); an output node's
    refusal was named by no input."""
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    (tmp_path / "input").mkdir()
    assert comfyui_errors(kind, _defaults(kind)) == []
    errors = comfyui_errors(kind, {**_defaults(kind), **changes})
    assert len(errors) == 1, errors
    assert errors[0]["extra_info"]["input_name"] == input_name and errors[0]["details"].startswith(text), errors
    assert "traceback" not in errors[0]["extra_info"] and "linked_node" not in errors[0]["extra_info"]


@pytest.mark.parametrize("kind", ["SegCkptSchedule", "SegCkptTrainLoRA", "SegCkptOffloadOptions",
                                  "SegCkptWeightOffload", "SegCkptLoRAConfig", "SegCkptImageCaptionDataset",
                                  "SegCkptFitGuardrails"])
def test_every_refused_option_names_the_nodes_own_input(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("SEGCKPT_BASE_DIR", str(tmp_path))
    cls, widgets = NODES[kind], _widgets(NODES[kind])
    defaults = {name: _default(spec) for name, spec in widgets.items()}
    if kind == "SegCkptImageCaptionDataset":
        defaults["folder"] = "(built-in sample photos)"
    assert cls.validate_inputs(**defaults, **SOCKETS) if kind == "SegCkptTrainLoRA" else cls.validate_inputs(**defaults)
    # a combo ComfyUI checks itself; a free list; a folder (tested apart); free text (the images' caption)
    skip = {"family", "target_modules", "folder", "caption"}
    for name, spec in widgets.items():
        if name in skip:
            continue
        value = _bad(name, spec)
        (error,) = comfyui_errors(kind, {**defaults, **(SOCKETS if kind == "SegCkptTrainLoRA" else {}), name: value})
        assert error["details"].startswith(f"{name}={value!r} is invalid"), (name, error)
        extra = error["extra_info"]
        assert extra["input_name"] == name and extra["input_config"][0] == spec[0]
        assert "linked_node" not in extra and "traceback" not in extra


@pytest.mark.parametrize("stride, interval, named", [(1, 2, "gradient_checkpointing_segment_stride"),
                                                     (2, 4, "gradient_checkpointing_segment_stride")])
def test_a_rule_across_two_inputs_names_the_one_it_refuses(stride, interval, named):
    cls = NODES["SegCkptSchedule"]
    inputs = {name: _default(spec) for name, spec in _widgets(cls).items()}
    message = _refused(cls, {**inputs, "gradient_checkpointing_interval": interval,
                             "gradient_checkpointing_segment_stride": stride})
    errors = _inner_error("SegCkptSchedule", message)
    name_inputs(errors, NODES)
    assert errors["1"]["errors"][0]["extra_info"]["input_name"] == named


def test_a_message_naming_no_input_drops_the_consumers_name_and_others_are_left_alone():
    errors = {**_inner_error("SegCkptTrainLoRA", "something went wrong"),
              "2": {"class_type": "KSampler", "errors": [{"type": "exception_during_inner_validation",
                                                         "details": "steps", "extra_info": {"input_name": "x"}}]}}
    assert name_inputs(errors, NODES)
    assert "input_name" not in errors["1"]["errors"][0]["extra_info"]
    assert errors["2"]["errors"][0]["extra_info"] == {"input_name": "x"}
    data = _inner_error("SegCkptTrainLoRA", "Train LoRA has no data: connect dataset (Image+Caption Dataset), or latent")
    name_inputs(data, NODES)
    assert data["1"]["errors"][0]["extra_info"]["input_name"] == "dataset"


def test_the_middleware_rewrites_prompt_answers_only():
    body = {"error": {"type": "prompt_outputs_failed_validation"},
            "node_errors": _inner_error("SegCkptTrainLoRA", "run_name='/x' is invalid: allowed a relative name")}

    async def go():
        app = web.Application(middlewares=[name_inputs_middleware])
        app.router.add_post("/prompt", lambda request: web.json_response(body, status=400))
        app.router.add_post("/api/prompt", lambda request: web.json_response(body, status=400))
        app.router.add_post("/other", lambda request: web.json_response(body, status=400))
        async with TestClient(TestServer(app)) as client:
            return [(r.status, await r.json()) for r in [await client.post(p) for p in ("/prompt", "/api/prompt", "/other")]]

    (s1, prompt), (s2, api), (s3, other) = asyncio.run(go())
    assert s1 == s2 == s3 == 400
    for answer in (prompt, api):
        assert answer["node_errors"]["1"]["errors"][0]["extra_info"]["input_name"] == "run_name"
    assert other["node_errors"]["1"]["errors"][0]["extra_info"]["input_name"] == "run"


@pytest.mark.parametrize("text, shown", [
    ("interrupted after step 3: state saved, resume with --resume", "interrupted after step 3: state saved, resume with resume=true"),
    ("pass --resume to continue it or --overwrite to replace it", "pass resume=true to continue it or overwrite=true to replace it"),
    ("use --base-precision bf16 (or fp32).", "use base_model_precision=bf16 (or fp32)."),
    ("(set --rank 4 to continue it)", "(set rank=4 to continue it)"),
    ("--no-checkpointing", "gradient_checkpointing=false"),
    ("give --budget for what each memory option saved", "give memory_budget for what each memory option saved"),
    ("choose another --output", "choose another run_name"),
    ("validation_every=-5 is invalid", "preview_every=-5 is invalid"),
    ("lora_rank=0 is invalid", "rank=0 is invalid"),
    ("fewer validation prompts, or validation_every 0", "fewer validation prompts, or preview_every 0"),
    ("torchrun --nproc-per-node N --no-python segckpt", "torchrun --nproc-per-node N --no-python segckpt"),
    ("wrote output/segckpt/run_00001/report.json", "wrote output/segckpt/run_00001/report.json"),
])
def test_the_engines_flags_read_as_the_nodes_inputs(text, shown):
    assert node_words(text) == shown


def test_no_absolute_path_survives_in_a_message(tmp_path):
    host = local_host(tmp_path)
    temporary = Path(tempfile.gettempdir()) / "segckpt-runs-ab" / "run-1" / "lora.safetensors"
    text = host.public(f"failed: {tmp_path}/output/x/report.json, {temporary} ({sys.prefix}/lib/site.py), "
                       f"{ROOT / 'engine' / 'api.py'}; run_name='/abs/x' (the user's own value)")
    assert text == ("failed: output/x/report.json, <tmp>/segckpt-runs-ab/run-1/lora.safetensors (<python>/lib/site.py), "
                    "<pack>/engine/api.py; run_name='/abs/x' (the user's own value)")


LOADER = r'''
import importlib.util, sys
path = sys.argv[1]
name = path.replace(".", "_x_")  # as ComfyUI's nodes.load_custom_node names a pack folder
spec = importlib.util.spec_from_file_location(name, path + "/__init__.py")
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
environment = sys.modules[name + ".nodes.environment"]
from importlib import import_module
api = import_module(name + ".engine.api")
def full_type_name(klass):  # ComfyUI's execution.full_type_name
    return klass.__qualname__ if klass.__module__ == "builtins" else klass.__module__ + "." + klass.__qualname__
errors = []
for kind, inputs in [("SegCkptSchedule", {"gradient_checkpointing_interval": 4, "gradient_checkpointing_segment_stride": 2}),
                     ("SegCkptTrainLoRA", {"steps": 0})]:
    try:
        sys.modules[name + ".nodes"].NODE_CLASS_MAPPINGS[kind].validate_inputs(**inputs)
    except Exception as exc:
        errors.append(full_type_name(type(exc)))
@environment.public_errors
def fails():
    raise api.PlannerError("nothing fits")
try:
    fails()
except Exception as exc:
    errors.append(full_type_name(type(exc)))
print("\n".join(errors))
'''


def test_error_types_hold_no_path_when_comfyui_imports_the_pack_by_its_folder(tmp_path):
    """ComfyUI imports a custom node under its folder's path and names an error's type by its
    class's module: the pack's error type reads the same as when installed."""
    pack = tmp_path / "custom_nodes" / "comfyui-segmented-checkpointing.v1"
    pack.parent.mkdir()
    pack.symlink_to(ROOT, target_is_directory=True)
    stubs = tmp_path / "stubs"  # ComfyUI's modules, as far as the pack uses them here
    (stubs / "comfy").mkdir(parents=True)
    (stubs / "comfy" / "__init__.py").write_text("")
    (stubs / "comfy" / "utils.py").write_text("class ProgressBar: pass\n")
    (stubs / "comfy" / "model_management.py").write_text(
        "class InterruptProcessingException(Exception): pass\n"
        "processing_interrupted = throw_exception_if_processing_interrupted = lambda: False\n")
    (stubs / "folder_paths.py").write_text(
        f"base_path = {str(tmp_path)!r}\nget_folder_paths = lambda kind: [base_path + '/models/' + kind]\n"
        "get_input_directory = lambda: base_path + '/input'\nget_output_directory = lambda: base_path + '/output'\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(stubs)}
    done = subprocess.run([sys.executable, "-c", LOADER, str(pack)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["segmented_checkpointing.nodes.environment.NodeError"] * 3, done.stdout
