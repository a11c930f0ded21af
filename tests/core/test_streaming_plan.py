"""The streaming keys, the plan's choice of streamed blocks and what every entry point shows of it."""

from __future__ import annotations

import pytest

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.plan import effective_plan
from segmented_checkpointing.engine.core.plan_query import plan_for_query
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.train.recovery import cheaper_schedules

FLUX = get_family("flux")


def test_keys_modes_and_errors():
    schedule = CheckpointSchedule(weight_offload="stream", weight_offload_blocks="all")
    assert schedule.weight_offload_blocks is None and schedule.mode == "layer-stream"
    assert CheckpointSchedule(weight_offload="stream", weight_offload_blocks=8, weight_offload_prefetch=2).mode \
        == "layer-stream8-p2"
    assert CheckpointSchedule(gradient_checkpointing=False, weight_offload="stream").mode == "none-stream"
    with pytest.raises(ScheduleError, match=r"weight_offload_blocks=3 is invalid with weight_offload='none'"):
        CheckpointSchedule(weight_offload_blocks=3)
    with pytest.raises(ScheduleError, match=r"weight_offload='swap' is invalid: allowed none, stream"):
        CheckpointSchedule(weight_offload="swap")
    with pytest.raises(ScheduleError, match=r"weight_offload_prefetch=9 is invalid: allowed an integer from 0 to 8"):
        CheckpointSchedule(weight_offload="stream", weight_offload_prefetch=9)
    from_strings = CheckpointSchedule.from_config({"weight_offload": "stream", "weight_offload_blocks": "4",
                                                   "weight_offload_prefetch": "2"})
    assert (from_strings.weight_offload_blocks, from_strings.weight_offload_prefetch) == (4, 2)


def test_simpletuner_block_swap_alias():
    config, ignored = TrainConfig.from_dict({"musubi_blocks_to_swap": 6})
    assert not ignored and config.schedule.streams and config.schedule.weight_offload_blocks == 6
    assert not TrainConfig.from_dict({"musubi_blocks_to_swap": 0})[0].schedule.streams
    assert CheckpointSchedule.from_config({"musubi_blocks_to_swap": "3"}).weight_offload_blocks == 3
    ours = TrainConfig.from_dict({"musubi_blocks_to_swap": 6, "weight_offload": "none"})[0]
    assert not ours.schedule.streams  # our own key wins
    with pytest.raises(ScheduleError, match="musubi_blocks_to_swap=-1 is invalid"):
        TrainConfig.from_dict({"musubi_blocks_to_swap": -1})


def test_refused_under_fsdp():
    with pytest.raises(ValueError, match=r"weight_offload='stream' is invalid: allowed none with fsdp"):
        TrainConfig.create(fsdp=True, weight_offload="stream")


def test_the_plan_spreads_n_streamed_blocks_and_shows_them():
    schedule = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
                                  weight_offload="stream", weight_offload_blocks=4)
    plan = effective_plan(FLUX, schedule, {"double": 8, "single": 8}, warn=False)
    # 16 blocks, 4 streamed: blocks 2, 6, 10, 14 of the model in forward order
    assert [lp.streamed for lp in plan.lists] == [(2, 6), (2, 6)]
    assert plan.stream_maps() == {"double": "..S...S.", "single": "..S...S."}
    text = plan.render()
    assert "..S...S.  weights streamed: 2 of 8" in text and "S = frozen weights streamed" in text
    data = plan.to_dict()
    assert data["stream_map"] == plan.stream_maps() and data["streamed_blocks"] == 4
    assert data["lists"][0]["streamed"] == [2, 6]
    every = effective_plan(FLUX, schedule.replace(weight_offload_blocks=None), {"double": 8, "single": 8}, warn=False)
    assert every.streamed_blocks == 16 and every.stream_maps()["single"] == "S" * 8
    resident = effective_plan(FLUX, CheckpointSchedule(), {"double": 8, "single": 8}, warn=False)
    assert resident.streamed_blocks == 0 and resident.stream_maps() == {} and "weights:" not in resident.render()


def test_more_blocks_than_the_model_has_stream_all_and_every_label_says_how_many():
    """weight_offload_blocks=99 on 4 blocks: the plan, its rendering, report.json's plan, the receipt
    and the node strip's label (the plan route) say 4 stream, and a note names 99 and 4 (issue 34)."""
    from types import SimpleNamespace

    from segmented_checkpointing.engine.measure.receipt import build_receipt, render_receipt

    asked = CheckpointSchedule(weight_offload="stream", weight_offload_blocks=99)
    plan = effective_plan(FLUX, asked, {"double": 2, "single": 2}, warn=False)
    assert plan.streamed_blocks == 4 and plan.mode == "layer-stream4"
    assert "weight_offload_blocks=99 is more than the 4 blocks the runner sees: all 4 stream" in plan.notes
    assert plan.render().splitlines()[0] == "plan (flux, layer-stream4):"
    data = plan.to_dict()
    assert data["mode"] == "layer-stream4" and data["schedule"]["weight_offload_blocks"] == 4
    result = SimpleNamespace(plan=plan, history=[], config=SimpleNamespace(timing_warmup_steps=1),
                             report={"totals": {"sec_per_step": 0.5}, "memory": {}})
    receipt = build_receipt(result, None)
    assert receipt["schedule"] == "layer-stream4"
    assert render_receipt(receipt).startswith("receipt: layer-stream4, 0.500 sec/step")
    answer = plan_for_query({"family": "flux", "size": "tiny", "weight_offload": "stream", "weight_offload_blocks": "99"})
    assert answer["mode"] == "layer-stream16" and answer["streamed_blocks"] == 16
    exact = effective_plan(FLUX, asked.replace(weight_offload_blocks=4), {"double": 2, "single": 2}, warn=False)
    assert exact.mode == "layer-stream4" and not any("more than" in n for n in exact.notes)


def test_the_plan_route_takes_the_stream_keys():
    answer = plan_for_query({"family": "flux", "size": "tiny", "weight_offload": "stream",
                             "weight_offload_blocks": "all"})
    assert answer["stream_map"] == {"double": "S" * 8, "single": "S" * 8} and answer["mode"] == "layer-stream"


def test_streaming_is_the_last_rung_of_the_oom_ladder():
    ladder = cheaper_schedules(CheckpointSchedule(gradient_checkpointing_interval=2,
                                                  gradient_checkpointing_segment_stride=4), FLUX)
    assert ladder[-2].mode == "layer-unsloth-offload-attn" and ladder[-1].mode == "layer-unsloth-offload-attn-stream"
    assert ladder[-1].weight_offload_blocks is None
    assert cheaper_schedules(ladder[-1], FLUX) == []
