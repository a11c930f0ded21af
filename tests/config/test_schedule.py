"""Schedule keys: validation (key named in every error), the pure plan function, config parsing."""

from __future__ import annotations

import json

import pytest

from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.plan import plan_block_list


@pytest.mark.parametrize("values, key", [
    ({"gradient_checkpointing_interval": 0}, "gradient_checkpointing_interval"),
    ({"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 2},
     "gradient_checkpointing_segment_stride"),
    ({"gradient_checkpointing_backend": "deepspeed"}, "gradient_checkpointing_backend"),
    ({"gradient_checkpointing_segment_stride": 4}, "gradient_checkpointing_segment_stride"),
    ({"gradient_checkpointing_offload_pin_memory_max_buckets": -1},
     "gradient_checkpointing_offload_pin_memory_max_buckets"),
    ({"gradient_checkpointing_interval": 1.5}, "gradient_checkpointing_interval"),
    ({"gradient_checkpointing": "yes"}, "gradient_checkpointing"),
])
def test_invalid_schedules_name_the_key(values, key):
    with pytest.raises(ScheduleError) as info:
        CheckpointSchedule(**values)
    message = str(info.value)
    assert key in message
    assert repr(next(iter(values.values()))) in message


def test_stride_without_interval_says_to_set_the_interval():
    with pytest.raises(ScheduleError, match="without gradient_checkpointing_interval"):
        CheckpointSchedule(gradient_checkpointing_segment_stride=4)


def test_defaults_are_the_documented_ones():
    s = CheckpointSchedule()
    assert (s.gradient_checkpointing, s.gradient_checkpointing_backend, s.interval, s.stride) == (True, "torch", 1, 1)
    assert s.gradient_checkpointing_offload_attention is False
    assert s.gradient_checkpointing_offload_pin_memory_max_buckets == 12
    assert s.mode == "layer"
    assert CheckpointSchedule(gradient_checkpointing=False).mode == "none"


def test_interval_one_is_exactly_per_block():
    plan = plan_block_list("blocks", 5, 1)
    assert plan.segments == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))
    assert plan.plain == ()


def test_interval_two_groups_pairs_with_a_shorter_tail():
    plan = plan_block_list("blocks", 7, 2)
    assert plan.segments == ((0, 2), (2, 4), (4, 6), (6, 7))
    assert plan.checkpointed == tuple(range(7))


def test_interval_three_tail():
    assert plan_block_list("b", 8, 3).segments == ((0, 3), (3, 6), (6, 8))


def test_stride_leaves_blocks_plain():
    plan = plan_block_list("double", 8, 2, 4)
    assert plan.segments == ((0, 2), (4, 6))
    assert plan.plain == (2, 3, 6, 7)
    assert plan.block_map() == "CC..CC.."
    assert plan.block_map("O", "a") == "OOaaOOaa"


def test_stride_tail_is_never_dropped():
    plan = plan_block_list("b", 9, 2, 4)
    assert plan.segments == ((0, 2), (4, 6), (8, 9))
    assert sorted(plan.checkpointed + plan.plain) == list(range(9))


def test_disabled_plan_is_empty():
    assert plan_block_list("b", 4, 2, enabled=False).segments == ()


def test_plan_function_rejects_bad_values():
    with pytest.raises(ScheduleError):
        plan_block_list("b", 4, 0)
    with pytest.raises(ScheduleError):
        plan_block_list("b", 4, 3, 2)


def test_simpletuner_config_strings():
    s = CheckpointSchedule.from_config({
        "gradient_checkpointing": "true",
        "gradient_checkpointing_backend": "torch",
        "gradient_checkpointing_interval": "2",
        "gradient_checkpointing_segment_stride": "None",
        "gradient_checkpointing_offload_pin_memory_max_buckets": "",
        "learning_rate": 1e-4,
    })
    assert (s.interval, s.gradient_checkpointing_segment_stride) == (2, None)
    assert s.gradient_checkpointing_offload_pin_memory_max_buckets == 12
    with pytest.raises(ScheduleError, match="gradient_checkpointing_interval"):
        CheckpointSchedule.from_config({"gradient_checkpointing_interval": "two"})


def test_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"gradient_checkpointing_interval": 2,
                                "gradient_checkpointing_segment_stride": 4}))
    assert CheckpointSchedule.from_json_file(path).mode == "interval2-stride4"
    path.write_text("[1, 2]")
    with pytest.raises(ScheduleError, match="JSON object"):
        CheckpointSchedule.from_json_file(path)
