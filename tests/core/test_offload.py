"""Offload backends: gradient equality for every family x backend x attention offload, counts,
the CPU-tracked peaks, and the host pool's bounds."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers import MODES, one_step, random_batch, tiny_model

from segmented_checkpointing.engine.config.backends import BACKENDS
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core import offload
from segmented_checkpointing.engine.core.memory import PeakMemory
from segmented_checkpointing.engine.core.offload import PinnedMemoryWarning
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import get_family

FAMILIES = ["flux", "sd3", "pixart", "wan", "sana", "qwenimage", "zimage", "lumina2"]
_reference: dict = {}

pytestmark = pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.core.offload.PinnedMemoryWarning")


def _worst(family, schedule, dropout):
    if (family, dropout) not in _reference:
        _reference[(family, dropout)] = one_step(family, MODES["none"], dropout)[0]
    reference = _reference[(family, dropout)]
    grads, calls, runner = one_step(family, schedule, dropout)
    return max((grads[k] - reference[k]).abs().max().item() for k in reference), runner


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attention", [False, True])
def test_gradients_equal_for_every_backend(family, backend, attention):
    for base, dropout in ((MODES["layer"], 0.0), (MODES["interval2-stride4"], 0.1)):
        schedule = base.replace(gradient_checkpointing_backend=backend,
                                gradient_checkpointing_offload_attention=attention)
        worst, runner = _worst(family, schedule, dropout)
        assert worst <= 1e-6, (family, schedule.mode, worst)
        if runner.offloader is not None:
            assert runner.offloader.stats.packed_in_recompute == 0
            routed = [p for p, bl in zip(runner.plan.lists, get_family(family).block_lists) if bl.routed]
            whole_block_everywhere = backend in ("torch", "unsloth") and all(not p.plain for p in routed)
            # attention offload acts outside whole-block regions; unsloth offloads boundary inputs
            assert (runner.offloader.stats.tensors > 0) == (backend.startswith("unsloth") or not whole_block_everywhere)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_offload_without_checkpointing(family):
    schedule = CheckpointSchedule(gradient_checkpointing=False, gradient_checkpointing_offload_attention=True)
    worst, runner = _worst(family, schedule, 0.0)
    assert worst <= 1e-6 and runner.offloader.stats.tensors > 0


@pytest.mark.parametrize("family", ["flux", "wan", "sd3"])
def test_unsloth_offloads_exactly_the_carried_boundary_inputs(family):
    _, _, runner = one_step(family, MODES["interval2-stride4"].replace(gradient_checkpointing_backend="unsloth"))
    adapter = get_family(family)
    expected = sum(len(plan.segments) * len(bl.carry.links)
                   for plan, bl in zip(runner.plan.lists, adapter.block_lists))
    assert runner.offloader.stats.tensors == expected
    assert runner.offloader.stats.packed_in_recompute == 0
    _, _, runner = one_step(family, MODES["interval2-stride4"].replace(gradient_checkpointing_backend="unsloth-ffn"))
    assert runner.offloader.stats.tensors == runner.plan.checkpointed_blocks  # one FFN input each


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_ffn_backend_recomputes_ffn_only(family):
    adapter, model = tiny_model(family)
    latents, sigmas, text = random_batch(adapter, model)
    schedule = MODES["interval2-stride4"].replace(gradient_checkpointing_backend="torch-ffn")
    runner = SegmentRunner(model, adapter, effective_plan(adapter, schedule, count_blocks(adapter, model))).install()
    attention_calls, ffn_calls = {}, {}
    for bl in adapter.block_lists:
        ffn_name = bl.ffn if isinstance(bl.ffn, str) else bl.ffn[0]
        for i, block in enumerate(adapter.blocks(model, bl)):
            block.get_submodule(bl.attention).register_forward_pre_hook(
                lambda *_, k=(bl.name, i): attention_calls.__setitem__(k, attention_calls.get(k, 0) + 1))
            block.get_submodule(ffn_name).register_forward_pre_hook(
                lambda *_, k=(bl.name, i): ffn_calls.__setitem__(k, ffn_calls.get(k, 0) + 1))
    out = runner.forward(**adapter.make_inputs(model, latents, sigmas, text))
    adapter.read_output(model, out, latents).square().mean().backward()
    assert set(attention_calls.values()) == {1}  # no attention sub-block recomputed
    for plan in runner.plan.lists:
        for i in range(plan.num_blocks):
            # the block calls its FFN once; a checkpointed FFN runs once more in backward (the
            # pre-hook sees the block's call; the recompute calls the original forward directly)
            assert ffn_calls[(plan.name, i)] == 1
    assert runner.stats.recomputed_ffn == runner.plan.checkpointed_blocks
    assert runner.stats.recomputed_blocks == 0


def _peak(family, backend, size=16):
    adapter, model = tiny_model(family)
    latents, sigmas, text = random_batch(adapter, model, size=size)
    schedule = CheckpointSchedule(gradient_checkpointing_backend=backend)
    runner = SegmentRunner(model, adapter, effective_plan(adapter, schedule, count_blocks(adapter, model))).install()
    inputs = adapter.make_inputs(model, latents, sigmas, text)
    pool = runner.offloader.pool if runner.offloader else None
    with PeakMemory("cpu", exclude=pool.is_host if pool else None).measure() as reading:
        out = runner.forward(**inputs)
        adapter.read_output(model, out, latents).square().mean().backward()
    return reading.peak_bytes


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_unsloth_device_side_peak_is_below_torch(family):
    assert _peak(family, "unsloth") < _peak(family, "torch")
    assert _peak(family, "unsloth-ffn") < _peak(family, "torch-ffn")


def _pool_run(max_buckets, steps=30, sizes=(8, 10, 12, 14)):
    adapter, model = tiny_model("flux", num_layers=2, num_single_layers=2)
    schedule = CheckpointSchedule(gradient_checkpointing_backend="unsloth",  # block 0 offloads its
                                  gradient_checkpointing_interval=1,     # boundary inputs, block 1
                                  gradient_checkpointing_segment_stride=2,  # its attention
                                  gradient_checkpointing_offload_attention=True,
                                  gradient_checkpointing_offload_pin_memory_max_buckets=max_buckets)
    runner = SegmentRunner(model, adapter, effective_plan(adapter, schedule, count_blocks(adapter, model))).install()
    pool, history = runner.offloader.pool, []
    for step in range(steps):
        latents, sigmas, text = random_batch(adapter, model, size=sizes[step % len(sizes)], seed=step)
        out = runner.forward(**adapter.make_inputs(model, latents, sigmas, text))
        adapter.read_output(model, out, latents).square().mean().backward()
        history.append((pool.pool_bytes, len(pool.keys), pool.pinned_buffers))
    return history


def test_pool_bytes_are_constant_after_warm_up_with_varying_lengths():
    history = _pool_run(12)
    assert history[9][0] > 0 and history[29][0] == history[9][0]
    assert max(h[1] for h in history) <= 12


def test_pool_bucket_limit_and_pageable_mode():
    assert max(h[1] for h in _pool_run(2, steps=8)) <= 2
    unpooled = _pool_run(0, steps=4)
    assert all(h == (0, 0, 0) for h in unpooled)  # no pool, nothing pinned


def test_pinning_is_skipped_with_one_warning_per_process_without_cuda(monkeypatch):
    """Each run builds its pool inside the training loop's own warning filters (engine/train/loop.py
    ``_work``: a ``catch_warnings`` that resets the warnings registry), so the registry cannot
    say it once: the pool does, once per process, not once per run (a sweep's cells; issue 34)."""
    if torch.cuda.is_available():
        pytest.skip("this machine can pin")
    monkeypatch.setattr(offload, "_SAID", set(), raising=False)  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per place in the code
        _pool_run(12, steps=2)
        for _ in range(3):  # three more runs, each inside its own filters, as the loop enters them
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
                offload.HostPool(12)
    pinned = [w for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    assert len(pinned) == 1 and "pinned host memory is not available without CUDA" in str(pinned[0].message)


def test_missing_boundaries_fail_before_training_naming_family_and_list():
    from segmented_checkpointing.engine.config import TrainConfig

    flux = get_family("flux")
    no_ffn = dataclasses.replace(flux, name="flux-no-ffn", block_lists=(
        flux.block_lists[0], dataclasses.replace(flux.block_lists[1], ffn=None)))
    with pytest.raises(ScheduleError, match=r"flux-no-ffn: block list\(s\) single have no FFN boundary"):
        effective_plan(no_ffn, CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"), {"double": 8, "single": 8})
    no_attn = dataclasses.replace(flux, name="flux-no-attn", block_lists=tuple(
        dataclasses.replace(bl, attention=None) for bl in flux.block_lists))
    with pytest.raises(ScheduleError, match="flux-no-attn: block list"):
        effective_plan(no_attn, CheckpointSchedule(gradient_checkpointing_offload_attention=True), {"double": 8, "single": 8})
    with pytest.raises(ScheduleError, match="flux-no-ffn"):
        from segmented_checkpointing.engine.families.registry import _REGISTRY
        _REGISTRY["flux-no-ffn"] = no_ffn
        try:
            TrainConfig.create(family="flux-no-ffn", schedule=CheckpointSchedule(gradient_checkpointing_backend="unsloth-ffn"))
        finally:
            del _REGISTRY["flux-no-ffn"]
