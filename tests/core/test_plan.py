"""Family rules in the effective plan, and the runner's fallback when a loop changes state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import MODES, random_batch, tiny_model

from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import ScheduleWarning, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import get_family

COUNTS = {"double": 8, "single": 8}


def test_family_without_interval_support_warns_and_runs_per_block():
    family = dataclasses.replace(get_family("flux"), name="flux-per-block", segmented=False)
    with pytest.warns(ScheduleWarning, match="gradient_checkpointing_interval=2"):
        plan = effective_plan(family, MODES["interval2-stride4"], COUNTS)
    assert all(p.segments == tuple((i, i + 1) for i in range(8)) for p in plan.lists)
    assert "ignored" in plan.notes[0]
    assert plan.to_dict()["notes"] == list(plan.notes)


def test_family_ignoring_stride_warns():
    family = dataclasses.replace(get_family("flux"), name="flux-no-stride", stride_honoured=False)
    with pytest.warns(ScheduleWarning, match="segment_stride=4"):
        plan = effective_plan(family, MODES["interval2-stride4"], COUNTS)
    assert plan.list_plan("double").segments == ((0, 2), (2, 4), (4, 6), (6, 8))


def test_each_list_gets_its_own_plan():
    plan = effective_plan(get_family("flux"), MODES["interval3"], {"double": 4, "single": 7})
    assert plan.list_plan("double").segments == ((0, 3), (3, 4))
    assert plan.list_plan("single").segments == ((0, 3), (3, 6), (6, 7))
    text = plan.render()
    assert "double  CCCC" in text and "single  CCCCCCC" in text and "legend" in text


def _controlnet_step(schedule):
    """One step of Flux with ControlNet residuals: the loop adds a residual after every block."""
    family, model = tiny_model("flux")
    latents, sigmas, text = random_batch(family, model)
    inputs = family.make_inputs(model, latents, sigmas, text)
    g = torch.Generator().manual_seed(7)
    width = model.inner_dim
    tokens = inputs["hidden_states"].shape[1]
    inputs["controlnet_block_samples"] = [torch.randn(2, tokens, width, generator=g) * 0.1 for _ in range(8)]
    runner = SegmentRunner(model, family, effective_plan(family, schedule, {"double": 8, "single": 8})).install()
    out = runner.forward(**inputs)
    family.read_output(model, out, latents).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, runner


def test_state_change_between_blocks_falls_back_to_per_block_with_a_warning():
    reference, _ = _controlnet_step(MODES["none"])
    with pytest.warns(ScheduleWarning, match="flux loop changes state between blocks of list 'double'"):
        grads, runner = _controlnet_step(MODES["interval2"])
    worst = max((grads[k] - reference[k]).abs().max().item() for k in grads)
    assert worst <= 1e-6
    assert runner.plan.list_plan("double").segments == tuple((i, i + 1) for i in range(8))
    assert runner.plan.list_plan("single").segments == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert len(runner.stats.fallbacks) == 1
    assert "fell back to per-block" in runner.plan.list_plan("double").notes[-1]


@pytest.mark.parametrize("backend, attention, expected", [
    ("torch", False, "CC..CC.."), ("unsloth", False, "OO..OO.."), ("torch-ffn", False, "FF..FF.."),
    ("unsloth-ffn", True, "ffaaffaa"), ("torch", True, "CCaaCCaa"),
])
def test_block_map_marks_what_each_block_does(backend, attention, expected):
    schedule = MODES["interval2-stride4"].replace(gradient_checkpointing_backend=backend,
                                                  gradient_checkpointing_offload_attention=attention)
    plan = effective_plan(get_family("flux"), schedule, COUNTS, warn=False)
    assert plan.block_maps() == {"double": expected, "single": expected}
    assert plan.to_dict()["block_map"]["double"] == expected and expected in plan.render()


def test_unrouted_lists_show_plain_even_with_attention_offload():
    schedule = CheckpointSchedule(gradient_checkpointing_offload_attention=True)
    plan = effective_plan(get_family("lumina2"), schedule, {"context_refiner": 2, "noise_refiner": 2, "layers": 4},
                          warn=False)
    assert plan.block_maps() == {"context_refiner": "..", "noise_refiner": "..", "layers": "CCCC"}
