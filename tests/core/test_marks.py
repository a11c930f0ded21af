"""Every mark the engine can emit has a colour and a label in the legend the plan serves to the strip."""

from __future__ import annotations

import itertools
import json
import re
import warnings

import pytest

from segmented_checkpointing.engine.config.backends import BACKENDS, RESIDENT, STREAM_MARKS, TABLE
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.plan import BLOCK_MARKS, LEGEND, effective_plan
from segmented_checkpointing.engine.families import family_names, get_family

OPTIONS = list(itertools.product(
    BACKENDS,
    (True, False),  # gradient_checkpointing
    (1, 2),  # interval: per block, or segments with plain blocks between them (stride 4)
    (False, True),  # save_attention
    (False, True),  # offload_attention
    (None, 2, "all"),  # weight_offload_blocks: resident, two blocks stream, all stream
))


def _schedule(backend, checkpointing, interval, save, attention, streamed) -> CheckpointSchedule:
    return CheckpointSchedule(
        gradient_checkpointing=checkpointing, gradient_checkpointing_backend=backend,
        gradient_checkpointing_interval=interval if interval > 1 else None,
        gradient_checkpointing_segment_stride=4 if interval > 1 else None,
        gradient_checkpointing_save_attention=save, gradient_checkpointing_offload_attention=attention,
        weight_offload="none" if streamed is None else "stream", weight_offload_blocks=streamed)


def _served_plans():
    """The served form (``to_dict``, what GET /segckpt/plan answers) of every plan the engine makes
    for every family (4 blocks per list) under every backend and option above, and under FSDP's
    checkpointing; a combination the schedule or the family refuses is left out (it has no plan)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in family_names():
            family = get_family(name)
            counts = {block_list.name: 4 for block_list in family.block_lists}
            for options in OPTIONS:
                try:
                    plan = effective_plan(family, _schedule(*options), counts, warn=False)
                except ScheduleError:
                    continue
                yield plan.to_dict()
            yield effective_plan(family, CheckpointSchedule(), counts, warn=False, fsdp_checkpointing=True).to_dict()


def test_every_mark_the_engine_emits_has_a_colour_and_a_label_in_the_served_legend():
    block, stream = set(), set()
    plans = 0
    for served in _served_plans():
        plans += 1
        served = json.loads(json.dumps(served))  # as the strip receives it
        emitted = set("".join(served["block_map"].values()))
        assert emitted <= set(served["marks"]), (served["mode"], emitted - set(served["marks"]))
        drawn = set("".join(served["stream_map"].values())) - {RESIDENT}
        assert drawn <= set(served["stream_marks"]), (served["mode"], drawn - set(served["stream_marks"]))
        block |= emitted
        stream |= drawn
        for style in [*served["marks"].values(), *served["stream_marks"].values()]:
            assert re.fullmatch(r"#[0-9a-f]{6}", style["color"]) and style["label"], style
    assert plans > 100
    # every mark declared is one the engine emits: the legend holds no dead entry
    assert block == {mark.char for mark in BLOCK_MARKS} == set("CKOkFfa.")
    assert stream == {mark.char for mark in STREAM_MARKS} == {"S"}
    colors = [mark.color for mark in (*BLOCK_MARKS, *STREAM_MARKS)]
    assert len(set(colors)) == len(colors), "each mark a colour of its own"
    assert len({mark.char for mark in BLOCK_MARKS}) == len(BLOCK_MARKS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_has_a_save_attention_mark_exactly_where_the_schedule_allows_save_attention(backend):
    try:
        CheckpointSchedule(gradient_checkpointing_backend=backend, gradient_checkpointing_save_attention=True)
        allowed = True
    except ScheduleError:
        allowed = False
    assert (TABLE[backend].save_attention_mark is not None) == allowed
    assert all(f"{mark.char} = {mark.text}" in LEGEND for mark in TABLE[backend].marks)
