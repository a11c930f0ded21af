"""The host arena (engine/core/arena.py): streamed weights' host copies and the activation offload
pool's buffers are views into a few power-of-two chunks planned from the bytes to place, on the CPU
by the same code path as pinned on CUDA (issue 36 item 2)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import MODES, tiny_model

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.core import arena
from segmented_checkpointing.engine.core.offload import HostPool
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.measure.host import streamed_host_bytes, streamed_sizes


def test_plan_chunks_exactly():
    # 10 tensors of 100 bytes: 256 aligned each, 2560 in all; a quarter (640) rounds up to 1024,
    # so 4 tensors per chunk and the last chunk shrinks to the power of two its 2 tensors need
    assert arena.plan_chunks([100] * 10) == [1024, 1024, 512]
    # the chunk is never smaller than the largest tensor; first fit fills the first chunk's end
    assert arena.plan_chunks([3000, 256, 256]) == [4096]
    assert arena.plan_chunks([]) == [] and arena.plan_chunks([0, 0]) == []
    assert arena.chunk_bytes(100 * 2**30) == arena.CHUNK_CAP  # a Flux-size base: 1 GiB chunks
    assert arena.planned_total(22 * 2**30 + 5) == 22 * 2**30 + 8
    assert arena.planned_total(3 * 2**20) == 3 * 2**20  # three full chunks of 1 MiB


def test_take_places_views_at_aligned_offsets_and_grows_by_doubling():
    chunks = []
    host = arena.HostArena(lambda n: chunks.append(torch.empty(n, dtype=torch.uint8)) or chunks[-1],
                           arena.plan_chunks([100] * 10))
    views = [host.take(100) for _ in range(10)]
    assert len(chunks) == 3 and host.allocated_bytes == 2560 and host.used_bytes == 1000
    assert [v.untyped_storage().data_ptr() for v in views] == [c.untyped_storage().data_ptr()
                                                                for c in chunks for _ in range(4)][:10]
    assert [v.storage_offset() for v in views] == [0, 256, 512, 768] * 2 + [0, 256]
    host.take(300)  # more than planned: a new chunk, the larger of 512 and what is allocated (2560 -> 4096)
    assert [c.numel() for c in chunks] == [1024, 1024, 512, 4096] and host.chunk_count == 4


@pytest.mark.parametrize("family_name, mode, blocks", [("flux", "interval2-stride4", None), ("wan", "layer", None),
                                                       ("flux", "none", 2)])
def test_every_streamed_weight_is_a_view_into_a_few_chunks(family_name, mode, blocks):
    """Tiny presets: <= 4 chunks; allocated <= 1.05x the streamed bytes + the last chunk's rounding
    (less than half of it); the host budget's estimate is what the run allocates."""
    family, model = tiny_model(family_name)
    schedule = MODES[mode].replace(weight_offload="stream", weight_offload_blocks=blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = SegmentRunner(model, family, effective_plan(family, schedule, count_blocks(family, model),
                                                             warn=False))
    streamer, weights = runner.streamer, runner.pool.weights
    masters = [leaf.master for unit in streamer.units for leaf in unit.leaves]
    assert masters and all(weights.owns(m) for m in masters)
    assert all((m.data_ptr() - m.untyped_storage().data_ptr()) % arena.ALIGN == 0 for m in masters)
    assert all(leaf.owner.data_ptr() == leaf.master.data_ptr() for u in streamer.units for leaf in u.leaves)
    assert 1 <= weights.chunk_count <= 4 and weights.used_bytes == streamer.streamed_bytes
    last = weights.chunks[-1].numel()
    assert weights.allocated_bytes <= 1.05 * streamer.streamed_bytes + last // 2
    figures = runner.weight_receipt()
    assert figures["host_arena_bytes"] == weights.allocated_bytes and figures["pinned_host_bytes"] == 0
    assert figures["host_arena_used_bytes"] == streamer.streamed_bytes
    config = TrainConfig.create(family=family_name, **schedule.to_dict())
    assert streamed_host_bytes(config.model, config.schedule) == weights.allocated_bytes  # the budget: as allocated
    assert sum(streamed_sizes(config.model, config.schedule)) == streamer.streamed_bytes


def test_offload_buffers_come_from_chunks():
    pool = HostPool(12)
    buffers = [pool.acquire(n, torch.float32)[0] for n in (100, 300, 100, 2000)]
    assert all(pool.activations.owns(b) for b in buffers)
    assert pool.pool_bytes == 512 + 2048 + 512 + 8192 == pool.activations.used_bytes
    # 512; 2048 (the request); 4096 (doubling what is allocated), its rest too small for 8192: 8192
    assert [c.numel() for c in pool.activations.chunks] == [512, 2048, 4096, 8192]
    pool.give_back(buffers[0], True)
    assert pool.acquire(50, torch.float32)[0] is buffers[0]  # reused, nothing new allocated
    assert pool.activations.allocated_bytes == 512 + 2048 + 4096 + 8192


def test_the_receipt_gives_host_memory_allocated_against_used_and_the_free_device_memory():
    from types import SimpleNamespace

    from segmented_checkpointing.engine.measure.receipt import build_receipt, render_receipt
    from segmented_checkpointing.engine.train.report import host_arena_section

    record = {"host_arena_bytes": 3 * 2**20, "host_arena_used_bytes": 2**21 + 2**20 // 2, "host_arena_chunks": 3,
              "pinned_host_bytes": 3 * 2**20}
    arena_ = host_arena_section(record)
    assert arena_ == {"allocated_bytes": 3 * 2**20, "used_bytes": 2621440, "ratio": 1.2, "chunks": 3,
                      "pinned_bytes": 3 * 2**20}
    assert host_arena_section({})["ratio"] is None
    plan = SimpleNamespace(mode="layer-stream")
    result = SimpleNamespace(plan=plan, history=[], config=SimpleNamespace(timing_warmup_steps=1), report={
        "totals": {"sec_per_step": 0.5}, "memory": {"host_arena": arena_, "device_free_bytes_at_start": 5 * 2**30}})
    receipt = build_receipt(result, None)
    assert receipt["host_arena"] == arena_ and receipt["device_free_bytes_at_start"] == 5 * 2**30
    assert render_receipt(receipt).splitlines()[1:3] == [
        "  device memory free at start: 5 GiB",
        "  host memory (streamed weights, offloaded activations): 3 MiB allocated in 3 chunk(s) for 2.5 MiB used "
        "(1.200x), 3 MiB pinned"]


def test_a_pin_that_fails_falls_back_to_plain_chunks_by_the_same_path(monkeypatch):
    """Asked to pin where it cannot (no CUDA here: ``pin_memory=True`` raises), the pool warns once and
    holds the weights in plain chunks: views, the same bytes, nothing counted as pinned."""
    from segmented_checkpointing.engine.core import offload

    monkeypatch.setattr(offload, "_SAID", set())
    if torch.cuda.is_available():
        pytest.skip("this machine can pin")
    pool = HostPool(0, pin=True)
    weights = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(5, dtype=torch.bfloat16)]
    pool.reserve([w.numel() * w.element_size() for w in weights])
    with pytest.warns(offload.PinnedMemoryWarning, match="streamed weights use pageable host memory"):
        held = [pool.hold(w) for w in weights]
    assert all(torch.equal(h, w) and h.dtype == w.dtype and pool.weights.owns(h) for h, w in zip(held, weights))
    # 512 aligned bytes: a quarter rounds to 128, so chunks of the largest tensor's 256, one each
    assert pool.arena_figures() == {"host_arena_bytes": 512, "host_arena_used_bytes": 34, "host_arena_chunks": 2,
                                    "pinned_host_bytes": 0}
    assert all(pool.is_host(h) for h in held) and pool.hold(held[0]) is held[0]  # held once
