"""A training run that streams its frozen weights: the same losses, a receipt of the copies, and a
resume that does not care whether the saved run streamed."""

from __future__ import annotations

import json

import pytest

from segmented_checkpointing.engine import api
from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.core.plan import HOST_STREAMING_NOTE
from segmented_checkpointing.engine.core.streaming import predicted_copies
from segmented_checkpointing.engine.measure import host

QUIET = {"log": lambda line: None}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    root = tmp_path_factory.mktemp("stream")
    write_sample_dataset(root / "data")
    return root


def _run(root, name, steps=3, **changes):
    config = TrainConfig.create(output=str(root / name), resolution=64, steps=steps, batch_size=2,
                                data=str(root / "data"), timing_warmup_steps=1, family="flux", **changes)
    lines = []
    api.train(config, log=lines.append)
    return json.loads((root / name / "report.json").read_text()), "\n".join(lines)


def test_losses_equal_and_the_report_counts_the_copies(data_dir):
    resident, _ = _run(data_dir, "resident")
    streamed, log = _run(data_dir, "streamed", weight_offload="stream")
    # on the CPU streaming saves nothing: said once in the log and once in report.json (issue 34)
    assert log.count(HOST_STREAMING_NOTE) == 1 and streamed["plan"]["notes"].count(HOST_STREAMING_NOTE) == 1
    assert HOST_STREAMING_NOTE not in resident["plan"]["notes"]
    assert [s["loss"] for s in streamed["steps"]] == [s["loss"] for s in resident["steps"]]
    assert "SSSSSSSS  weights streamed: 8 of 8" in log and "weights in" in log
    units = 12  # the demo schedule (interval 2 stride 4): segments 0-1 and 4-5 are one unit each
    assert [s["weight_copies"] for s in streamed["steps"]] == [predicted_copies(units, 1, s == 0) for s in range(3)]
    for step in streamed["steps"]:
        assert step["weight_d2h_bytes"] == 0 and step["weight_h2d_bytes"] > 0 and step["weight_stall_s"] >= 0
        assert step["streamed_frozen_bytes"] > 0 and step["pinned_host_bytes"] == 0  # nothing pinned on a CPU
    for step in resident["steps"]:
        assert step["weight_copies"] == step["weight_h2d_bytes"] == step["streamed_frozen_bytes"] == 0
    # the device holds the non-block weights and a ring of two units instead of every block's weights
    saved = resident["steps"][-1]["resident_frozen_bytes"] - streamed["steps"][-1]["resident_frozen_bytes"]
    assert saved > 0.5 * streamed["steps"][-1]["streamed_frozen_bytes"]
    assert streamed["steps"][-1]["device_peak_bytes"] == resident["steps"][-1]["device_peak_bytes"] - saved
    assert streamed["config"]["schedule"]["weight_offload"] == "stream"
    assert streamed["plan"]["stream_map"] == {"double": "S" * 8, "single": "S" * 8}
    # the host arena (issue 36): allocated against used, as allocated in the chunks; nothing pinned on a CPU
    last, arena = streamed["steps"][-1], streamed["memory"]["host_arena"]
    assert arena == {"allocated_bytes": last["host_arena_bytes"], "used_bytes": last["host_arena_used_bytes"],
                     "ratio": round(last["host_arena_bytes"] / last["host_arena_used_bytes"], 4),
                     "chunks": last["host_arena_chunks"], "pinned_bytes": 0}
    assert arena["used_bytes"] == last["streamed_frozen_bytes"] and 1 <= arena["chunks"] <= 4
    assert 1.0 < arena["ratio"] <= 1.05 + (arena["allocated_bytes"] / arena["chunks"] / 2) / arena["used_bytes"]
    assert streamed["receipt"]["host_arena"] == arena
    assert (f"  host memory (streamed weights, offloaded activations): {arena['allocated_bytes'] / 2**20:.3g} MiB "
            f"allocated in {arena['chunks']} chunk(s)") in log
    assert resident["memory"]["host_arena"]["allocated_bytes"] == 0 and "host_arena" not in resident["receipt"]
    assert streamed["memory"]["device_free_bytes_at_start"] is None  # a CUDA figure
    assert "device_free_bytes_at_start" not in streamed["receipt"] and "device memory free at start" not in log


def test_a_streamed_run_resumes_without_streaming(data_dir):
    straight, _ = _run(data_dir, "straight", steps=3)
    _run(data_dir, "halves", steps=2, weight_offload="stream", weight_offload_blocks=4)
    resumed, _ = _run(data_dir, "halves", steps=3, resume=True)
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in straight["steps"]]


def test_out_of_memory_on_the_last_schedule_rung_switches_to_streaming(data_dir):
    """Streaming is the ladder's rung after attention offload: the run streams from the failed step
    on and its losses equal an uninterrupted run's (neither changes the gradients)."""
    import torch

    from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
    from segmented_checkpointing.engine.model.bundle import build_preset
    from segmented_checkpointing.engine.train.loop import TrainingRun

    last = CheckpointSchedule(gradient_checkpointing_backend="unsloth", gradient_checkpointing_offload_attention=True)
    config = TrainConfig.create(output=str(data_dir / "oom"), resolution=64, steps=3, batch_size=2, family="flux",
                                data=str(data_dir / "data"), timing_warmup_steps=1, schedule=last)
    run = TrainingRun(config, bundle=build_preset("flux"), log=lambda line: None)
    records = []
    for record in run:
        records.append(record)
        if record.step == 1:
            ctx = run.context
            first = ctx.family.blocks(ctx.model, ctx.family.block_lists[0])[0]

            def hook(_module, _args, ctx=ctx):
                if not ctx.config.schedule.streams and ctx.runner.stats.recomputed_blocks > 0:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")

            first.register_forward_pre_hook(hook)
    switch = records[1].schedule_switches[0]
    assert (switch["from"], switch["to"]) == ("layer-unsloth-offload-attn", "layer-unsloth-offload-attn-stream")
    assert [r.streaming.weight_copies > 0 for r in records] == [False, True, True]
    plain, _ = _run(data_dir, "oom-reference", schedule=last)
    assert [r.loss for r in records] == [s["loss"] for s in plain["steps"]]


def test_previews_sample_the_same_images_while_streaming(data_dir, monkeypatch):
    """The sampler streams too: with every weight out of the ring poisoned (strict), the previews
    are the resident run's, byte for byte."""
    from segmented_checkpointing.engine.core.runner import SegmentRunner
    from segmented_checkpointing.engine.train import setup

    class Strict(SegmentRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, strict_streaming=True)

    previews = {"validation_every": 2, "validation_num_inference_steps": 2}
    resident, _ = _run(data_dir, "previews-resident", steps=2, **previews)
    monkeypatch.setattr(setup, "SegmentRunner", Strict)
    streamed, _ = _run(data_dir, "previews-streamed", steps=2, weight_offload="stream", weight_offload_blocks=5,
                       **previews)
    files = resident["steps"][-1]["previews"]
    assert files and files == streamed["steps"][-1]["previews"]
    for name in files:
        assert (data_dir / "previews-streamed" / name).read_bytes() == (data_dir / "previews-resident" / name).read_bytes()


def test_a_stream_the_host_cannot_hold_is_refused_before_any_model_is_built(data_dir, monkeypatch):
    from helpers import refuse_to_build_models

    refuse_to_build_models(monkeypatch, "the host memory was checked")
    monkeypatch.setattr(host, "host_budget_bytes", lambda *a: 1000)  # what the facade's train reads
    config = TrainConfig.create(output=str(data_dir / "host"), data=str(data_dir / "data"), weight_offload="stream")
    with pytest.raises(api.HostBudgetError, match=r"host_budget=default \(9.313e-07 GiB\) is too small: "
                                                  r"weight_offload=stream \(interval2-stride4-stream\) keeps \d+ bytes"):
        api.train(config, **QUIET)
