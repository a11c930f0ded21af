"""Shared test helpers: one LoRA training step of a tiny preset under a schedule."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.core.streaming import StreamingWarning
from segmented_checkpointing.engine.families import TextBatch, get_family
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.model.precision import apply_base_precision, resolve_precision

MODES = {
    "none": CheckpointSchedule(gradient_checkpointing=False),
    "layer": CheckpointSchedule(),
    "interval2": CheckpointSchedule(gradient_checkpointing_interval=2),
    "interval3": CheckpointSchedule(gradient_checkpointing_interval=3),
    "interval2-stride4": CheckpointSchedule(gradient_checkpointing_interval=2,
                                            gradient_checkpointing_segment_stride=4),
}


_PROTOTYPES: dict = {}


def pack_only(workflow) -> bool:
    """Whether an API workflow file holds only this pack's nodes (what `segckpt run` runs)."""
    import json

    from segmented_checkpointing.nodes import NODE_CLASS_MAPPINGS

    graph = json.loads(workflow.read_text())
    return all(node["class_type"] in NODE_CLASS_MAPPINGS for node in graph.values())


def verdict(cls, **inputs):
    """What ComfyUI reports for a node's VALIDATE_INPUTS: True, or the message (raised, so that
    ComfyUI lists it once; a returned one would be listed once per input the validator takes)."""
    try:
        return cls.validate_inputs(**inputs)
    except ValueError as exc:
        return str(exc)


def tiny_model(family_name: str, dropout: float = 0.0, seed: int = 0, lora: LoraSettings | None = None,
               base: str | None = None, **overrides):
    """A tiny random-init model with an adapter whose zero-initialised tensors (LoRA's B, LoKr's w1,
    LoHa's w2_b) are non-zero (so every adapter weight gets a gradient).

    Args:
        lora: the adapter (default: rank 4, alpha 8, ``dropout``). base: a ``base_model_precision``
            applied on the CPU before the adapter is added, as a run does (default: fp32, none).

    Built once per argument set and deep-copied afterwards (building + LoRA injection costs ~1 s).
    """
    key = (family_name, dropout, seed, lora, base, tuple(sorted(overrides.items())))
    if key not in _PROTOTYPES:
        _PROTOTYPES[key] = _build(family_name, dropout, seed, lora, base, overrides)
    family, model = _PROTOTYPES[key]
    return family, copy.deepcopy(model)


def _build(family_name, dropout, seed, lora, base, overrides):
    family = get_family(family_name)
    torch.manual_seed(seed)
    model = family.model_cls()(**{**family.tiny_config, **overrides})
    if base is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply_base_precision(model, resolve_precision(base, "no", torch.device("cpu")), torch.device("cpu"))
    lora = lora or LoraSettings(rank=4, alpha=8, dropout=dropout, init="gaussian")
    add_lora(model, lora, family.lora_targets, family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and not p.any():  # LoRA's B, LoKr's w1, LoHa's w2_b start at zero
                p.normal_(0, 0.02)
    return family, model


def random_batch(family, model, batch: int = 2, size: int = 8, seed: int = 1):
    """Random latents, sigmas and text conditioning shaped for ``family``'s tiny preset."""
    g = torch.Generator().manual_seed(seed)
    spec = family.text(model.config)
    shape = (batch, family.latent_channels, 1, size, size) if family.video_latents else (batch, family.latent_channels, size, size)
    latents = torch.randn(shape, generator=g)
    sigmas = torch.rand(1 if family.shared_sigma else batch, generator=g).expand(batch).contiguous()
    seq = torch.randn(batch, spec.max_length, spec.seq_dim, generator=g)
    pooled = torch.randn(batch, spec.pooled_dim, generator=g) if spec.pooled_dim else None
    mask = torch.ones(batch, spec.max_length, dtype=torch.bool)
    return latents, sigmas, TextBatch(seq, mask, pooled)


def one_step(family_name: str, schedule: CheckpointSchedule, dropout: float = 0.0, lora: LoraSettings | None = None,
             base: str | None = None, strict_streaming: bool = False, **overrides):
    """Forward + backward of one batch; returns (LoRA grads by name, block calls, runner).

    Args:
        lora, base, overrides: the adapter, base precision and config changes (:func:`tiny_model`).
        strict_streaming: a streamed weight read outside its use is NaN (``engine/core/streaming.py``).
    """
    family, model = tiny_model(family_name, dropout, lora=lora, base=base, **overrides)
    latents, sigmas, text = random_batch(family, model)
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StreamingWarning)  # a ring that saves nothing on a tiny model
        runner = SegmentRunner(model, family, plan, strict_streaming=strict_streaming).install()
    calls: dict[tuple[str, int], int] = {}
    for bl in family.block_lists:
        for i, block in enumerate(family.blocks(model, bl)):
            def hook(_m, _a, key=(bl.name, i)):
                calls[key] = calls.get(key, 0) + 1
            block.register_forward_pre_hook(hook)
    torch.manual_seed(123)
    output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
    pred = family.read_output(model, output, latents)
    loss = (pred.float() - latents).pow(2).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, calls, runner


WORDS = ("[PAD]", "[UNK]", "a", "cat", "dog", "photo", "of", "the", "</s>")


def save_tiny_text_encoder(folder, kind: str, width: int = 32, projection: int | None = None, seed: int = 0,
                           tokenizer_folder=None):
    """A tiny random transformers text encoder with a word-level tokenizer, saved offline.

    ``kind``: ``clip`` (``CLIPTextModel``, or ``CLIPTextModelWithProjection`` when ``projection``
    is given) or ``t5`` (``T5EncoderModel``); ``width`` is its hidden size. The tokenizer goes
    into ``tokenizer_folder`` (a pipeline's ``tokenizer_2``), default ``folder``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tokenizer_folder or folder)
    torch.manual_seed(seed)
    if kind == "clip":
        config = CLIPTextConfig(vocab_size=len(WORDS), hidden_size=width, intermediate_size=37, num_hidden_layers=2,
                                num_attention_heads=2, max_position_embeddings=77, projection_dim=projection or width,
                                pad_token_id=0, bos_token_id=2, eos_token_id=len(WORDS) - 1)
        model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    else:
        model = T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=width, d_kv=8, d_ff=37, num_layers=1,
                                        num_heads=2, pad_token_id=0, eos_token_id=len(WORDS) - 1))
    model.save_pretrained(folder)
    return folder


def full_and_resumed(make_config, stop_after: int, **kwargs):
    """One run to its end, and one stopped after ``stop_after`` steps then resumed: ``(full, resumed)``.

    ``make_config(name, **changes)`` gives the config of output folder ``name`` (``full``, ``split``);
    ``kwargs`` go to :func:`train` (``log=``).
    """
    from segmented_checkpointing.engine.train.loop import train

    full = train(make_config("full"), **kwargs)
    stops = iter(range(1, 1_000_000))
    first = train(make_config("split"), should_stop=lambda: next(stops) == stop_after, **kwargs)
    assert first.interrupted and len(first.history) == stop_after
    return full, train(make_config("split", resume=True), **kwargs)


def refuse_to_build_models(monkeypatch, before: str) -> None:
    """Make loading any model fail the test: the claim is that ``before`` happens first (options
    validated, a damaged file reported) and no model is built."""
    from segmented_checkpointing.engine.model import loading
    from segmented_checkpointing.engine.train import setup

    def refuse(*args, **kwargs):
        raise AssertionError(f"a model was built before {before}")

    monkeypatch.setattr(setup, "load_bundle", refuse)
    monkeypatch.setattr(loading, "load_bundle", refuse)  # the facade's load_model imports it when called


def object_info_as_v1(info: dict) -> dict:
    """A node's ``/object_info`` entry with what ComfyUI's V3 schema adds undone, to compare with the
    entries recorded from the pack's classic (V1) nodes (``tests/nodes/fixtures/object_info.json``,
    ComfyUI 0.3.64). What V3 adds (``comfy_api/latest/_io.py``, ``Schema.get_v1_info``), all of it:

    - ``output_tooltips`` (``None`` per output: none has one), ``deprecated``, ``experimental`` and
      ``api_node`` (``False``): V1 lists them only when a node sets them;
    - a combo as ``["COMBO", {"options": [...], "multiselect": false, ...}]`` for V1's ``[[...], {...}]``;
    - a STRING widget's ``"multiline": false``;
    - a hidden input as ``[TYPE]`` for V1's ``TYPE``, and an output node's hidden ``prompt`` and
      ``extra_pnginfo`` (``Schema.finalize``).

    Anything else that differs is left as it is, so that the comparison fails on it.
    """
    import json

    info = json.loads(json.dumps(info))  # tuples as lists, as the JSON of /object_info has them
    if info.get("output_tooltips") == [None] * len(info["output"]):
        del info["output_tooltips"]
    for key in ("deprecated", "experimental", "api_node"):
        if info.get(key) is False:
            del info[key]
    hidden, order = info["input"].get("hidden", {}), info["input_order"]
    for name, kind in (("prompt", "PROMPT"), ("extra_pnginfo", "EXTRA_PNGINFO")):
        if info["output_node"] and hidden.get(name) == [kind]:
            del hidden[name]
            order["hidden"].remove(name)
    info["input"]["hidden"] = {name: kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
                               for name, kind in hidden.items()}
    if not info["input"]["hidden"]:
        del info["input"]["hidden"]
        order.pop("hidden", None)
    for section in ("required", "optional"):
        for name, (kind, *options) in info["input"].get(section, {}).items():
            spec = dict(options[0]) if options else {}
            if kind == "COMBO" and spec.pop("multiselect", None) is False:
                info["input"][section][name] = [spec.pop("options"), spec]
            elif kind == "STRING" and spec.get("multiline") is False:
                del spec["multiline"]
                info["input"][section][name] = [kind, spec]
    return info


MEASURE_TOOLTIPS = {("SegCkptSweep", "warmup_steps"), ("SegCkptSweep", "measured_steps"),
                    ("SegCkptSweep", "attention_offload_modes"), ("SegCkptSweep", "budget_gib"),
                    ("SegCkptSchedulePlanner", "warmup_steps"), ("SegCkptSchedulePlanner", "measured_steps")}
"""Inputs whose tooltip is now their measurement option's help text (issue 37 item 1: declared once,
``engine/config/measure.py``); every other field of theirs is compared."""
UNIFIED_DEFAULTS = {("SegCkptSchedulePlanner", "measured_steps"): (2, 3)}
"""(recorded, now): the planner's timing steps had three defaults (CLI 3, node 2, ``api.plan`` 0);
issue 37 item 1 declares one, the CLI's. A saved workflow keeps the value it stored."""


def _without_measure_tooltips(kind: str, entry: dict) -> dict:
    entry = json.loads(json.dumps({k: v for k, v in entry.items() if k != "python_module"}))
    for node, name in MEASURE_TOOLTIPS:
        if node == kind:
            entry["input"]["required"][name][1].pop("tooltip")
    return entry


def recorded_object_info(kind: str) -> dict:
    """``tests/nodes/fixtures/object_info.json``'s entry of ``kind`` (the classic nodes' /object_info)
    with the deliberate changes above: the unified defaults; the measurement tooltips left out."""
    recorded = json.loads((Path(__file__).parent / "nodes" / "fixtures" / "object_info.json").read_text())[kind]
    entry = _without_measure_tooltips(kind, recorded)
    for (node, name), (_, now) in UNIFIED_DEFAULTS.items():
        if node == kind:
            entry["input"]["required"][name][1]["default"] = now
    return entry


def comparable_object_info(kind: str, info: dict) -> dict:
    """A V1 rendering of ``kind``'s entry (:func:`object_info_as_v1` done) as :func:`recorded_object_info` holds it."""
    return _without_measure_tooltips(kind, info)
