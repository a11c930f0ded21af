"""Every family x every mode: LoRA gradients equal the no-checkpoint run's; recomputes equal the plan."""

from __future__ import annotations

import pytest
from helpers import MODES, one_step

from segmented_checkpointing.engine.families import family_names, get_family

ISSUE2_FAMILIES = ["flux", "sd3", "pixart", "wan", "sana", "qwenimage", "zimage", "lumina2"]
FAMILIES = family_names()  # every registered family (engine/families/*.py)


def test_issue_families_registered():
    assert set(ISSUE2_FAMILIES) <= set(family_names())


_reference: dict = {}


def _reference_grads(family: str, dropout: float):
    key = (family, dropout)
    if key not in _reference:
        _reference[key] = one_step(family, MODES["none"], dropout)[0]
    return _reference[key]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["none", "layer", "interval2", "interval3", "interval2-stride4"])
def test_gradients_equal_and_recomputes_match_plan(family, mode):
    reference = _reference_grads(family, 0.0)
    grads, calls, runner = one_step(family, MODES[mode])
    assert grads.keys() == reference.keys() and grads
    worst = max((grads[k] - reference[k]).abs().max().item() for k in grads)
    assert worst <= 1e-6, f"{family}/{mode}: max abs grad diff {worst}"
    assert any(g.abs().sum() > 0 for g in grads.values())
    plan = runner.plan
    for list_plan in plan.lists:
        checkpointed = set(list_plan.checkpointed)
        for i in range(list_plan.num_blocks):
            expected = 2 if i in checkpointed else 1
            assert calls.get((list_plan.name, i), 0) == expected, (family, mode, list_plan.name, i)
    assert runner.stats.recomputed_blocks == plan.checkpointed_blocks
    if mode == "none":
        assert plan.checkpointed_blocks == 0
    elif mode != "interval2-stride4":
        routed = [p for p, bl in zip(plan.lists, get_family(family).block_lists) if bl.routed]
        assert all(len(p.checkpointed) == p.num_blocks for p in routed)
    assert not runner.stats.fallbacks, runner.stats.fallbacks
    assert runner.stats.undeclared_calls == 0, "the model checkpoints modules the adapter does not declare"


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_gradients_equal_with_lora_dropout(family):
    reference = _reference_grads(family, 0.1)
    grads, _, _ = one_step(family, MODES["interval2-stride4"], dropout=0.1)
    worst = max((grads[k] - reference[k]).abs().max().item() for k in grads)
    assert worst <= 1e-6


def _has_ffn(family: str) -> bool:
    routed = [bl for bl in get_family(family).block_lists if bl.routed]
    return bool(routed) and all(bl.ffn for bl in routed)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ISSUE2_FAMILIES and _has_ffn(f)])
def test_ffn_backend_gradients_equal(family):
    """Families added after the offload issue: ``torch-ffn`` where an FFN boundary is declared
    (the issue-2 families run every backend in test_offload.py)."""
    reference = _reference_grads(family, 0.0)
    grads, _, runner = one_step(family, MODES["interval2-stride4"].replace(gradient_checkpointing_backend="torch-ffn"))
    worst = max((grads[k] - reference[k]).abs().max().item() for k in grads)
    assert worst <= 1e-6, f"{family}/torch-ffn: max abs grad diff {worst}"
    assert runner.stats.recomputed_ffn == runner.plan.checkpointed_blocks > 0
    assert runner.stats.recomputed_blocks == 0
