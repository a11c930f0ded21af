"""Weight streaming (engine/core/streaming.py): LoRA gradients equal the resident run's for every
schedule, backend and streaming option, and the mechanism does what docs/STREAMING.md says."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from helpers import MODES, one_step, random_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.core.streaming import predicted_copies
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.lora_files import add_lora
from segmented_checkpointing.engine.model.precision import apply_base_precision, resolve_precision

STRIDE = MODES["interval2-stride4"]
_S = {"weight_offload": "stream"}
CASES = {  # every schedule, backend, attention offload, block count (all, 2) and prefetch (0, 1, 2)
    "none": MODES["none"].replace(**_S),
    "none-offload-attn-blocks2": MODES["none"].replace(**_S, gradient_checkpointing_offload_attention=True,
                                                       weight_offload_blocks=2),
    "layer-p0": MODES["layer"].replace(**_S, weight_offload_prefetch=0),
    "layer-unsloth-ffn-p2": MODES["layer"].replace(**_S, gradient_checkpointing_backend="unsloth-ffn",
                                                   weight_offload_prefetch=2),
    "interval2-p2": MODES["interval2"].replace(**_S, weight_offload_prefetch=2),
    "interval2-unsloth": MODES["interval2"].replace(**_S, gradient_checkpointing_backend="unsloth"),
    "stride": STRIDE.replace(**_S),
    "stride-unsloth-blocks2": STRIDE.replace(**_S, gradient_checkpointing_backend="unsloth", weight_offload_blocks=2),
    "stride-torch-ffn-offload-attn": STRIDE.replace(**_S, gradient_checkpointing_backend="torch-ffn",
                                                    gradient_checkpointing_offload_attention=True),
}
_REFERENCE: dict = {}


def _strict_step(family_name, schedule):
    """``one_step`` with the streamer strict: a weight read outside its use is NaN."""
    return one_step(family_name, schedule, strict_streaming=True)


@pytest.mark.parametrize("family_name", ["flux", "wan"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_gradients_equal_the_resident_run(family_name, case):
    schedule = CASES[case]
    if family_name not in _REFERENCE:
        _REFERENCE[family_name] = one_step(family_name, MODES["none"])[0]
    reference = _REFERENCE[family_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads, _, runner = _strict_step(family_name, schedule)
    assert runner.streamer is not None and runner.streamer.stats.copies > 0
    expected_streamed = schedule.weight_offload_blocks or sum(lp.num_blocks for lp in runner.plan.lists)
    assert runner.plan.streamed_blocks == expected_streamed
    assert grads.keys() == reference.keys()
    for name in reference:
        assert torch.allclose(grads[name], reference[name], atol=1e-6, rtol=0), (case, name)
    assert runner.streamer.stats.d2h_bytes == 0


def test_the_mechanism_slots_ring_and_copies_over_five_steps():
    """While a streamed block runs (forward or recompute), its frozen weights are views of ring
    slots; at no moment more than prefetch + 1 units are in slots; copies per step are what the
    plan predicts; no device-to-host weight bytes; the slots are allocated once."""
    family, model = tiny_model("flux")
    schedule = STRIDE.replace(weight_offload="stream", weight_offload_prefetch=1)
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    runner = SegmentRunner(model, family, plan).install()
    streamer = runner.streamer
    slots = set(streamer.slot_storages)
    seen = {"checks": 0, "max_in_slots": 0}

    def check(module, args):
        frozen = [p for p in module.parameters() if not p.requires_grad]
        assert frozen and all(p.untyped_storage().data_ptr() in slots for p in frozen)
        in_slots = sum(u.slot is not None for u in streamer.units)
        seen["max_in_slots"] = max(seen["max_in_slots"], in_slots)
        seen["checks"] += 1

    for bl in family.block_lists:
        for block in family.blocks(model, bl):
            block.register_forward_pre_hook(check)  # after the streamer's own pre-hook
            block.register_forward_hook(lambda m, a, o: check(m, a))
    units = len(streamer.units)
    assert units == 12  # flux tiny: 8 + 8 blocks, segments 0-1 4-5 of each list are one unit each
    copies = []
    for step in range(5):
        streamer.stats.reset()
        latents, sigmas, text = random_batch(family, model, seed=step)
        output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
        family.read_output(model, output, latents).float().pow(2).mean().backward()
        copies.append(streamer.stats.copies)
        assert streamer.stats.d2h_bytes == 0
        # every unit in forward and backward, less the two still in the ring at each turn
        size = [sum(leaf.nbytes for leaf in u.leaves) for u in streamer.units]
        kept = sum(size[-2:]) + (sum(size[:2]) if step else 0)
        assert streamer.stats.h2d_bytes == 2 * sum(size) - kept
    assert copies == [predicted_copies(units, 1, first_step=s == 0) for s in range(5)] == [22, 20, 20, 20, 20]
    assert seen["max_in_slots"] <= 2 and seen["checks"] > 5 * 2 * 16
    assert set(streamer.slot_storages) == slots and len(streamer.slots) == 2  # allocated once
    runner.close()
    assert all(p.untyped_storage().data_ptr() not in slots for p in model.parameters())


def test_int8_streams_about_half_the_bytes_of_bf16():
    """A quantized base streams its quantized bytes and scales, never a dequantized copy."""
    overrides = {"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 16}
    moved = {}
    family = get_family("flux")
    for base in ("bf16", "int8-torchao"):
        torch.manual_seed(0)
        model = family.model_cls()(**{**family.tiny_config, **overrides})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precision = resolve_precision(base, "no", torch.device("cpu"))
            apply_base_precision(model, precision, torch.device("cpu"))  # then the LoRA, as in a run
            add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), family.lora_targets)
        schedule = MODES["layer"].replace(weight_offload="stream")
        runner = SegmentRunner(model, family, effective_plan(family, schedule, count_blocks(family, model),
                                                             warn=False)).install()
        latents, sigmas, text = random_batch(family, model)
        with precision.autocast(torch.device("cpu")):
            output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
            loss = family.read_output(model, output, latents).float().pow(2).mean()
        loss.backward()
        assert torch.isfinite(loss)
        moved[base] = runner.streamer.stats.h2d_bytes
    assert 0 < moved["int8-torchao"] <= 0.55 * moved["bf16"], moved  # measured 0.513: int8 data + fp32 scales


def test_predicted_copies():
    assert predicted_copies(8, 1, True) == 14 and predicted_copies(8, 1, False) == 12
    assert predicted_copies(8, 0, False) == 14 and predicted_copies(1, 2, False) == 0


def test_no_stream_no_streamer():
    _, _, runner = one_step("flux", CheckpointSchedule())
    assert runner.streamer is None and runner.weight_receipt()["weight_h2d_bytes"] == 0


def test_the_ring_never_holds_more_slots_than_units_and_says_when_it_saves_nothing():
    from segmented_checkpointing.engine.core.streaming import StreamingWarning

    family, model = tiny_model("flux")
    schedule = MODES["layer"].replace(weight_offload="stream", weight_offload_blocks=2, weight_offload_prefetch=8)
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    with pytest.warns(StreamingWarning, match="saves no device memory here: the ring of 2 slot"):
        runner = SegmentRunner(model, family, plan)
    assert len(runner.streamer.slots) == len(runner.streamer.units) == 2


class _Copies(TorchDispatchMode):
    """Counts the aten ``copy_`` calls dispatched."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_a_unit_is_copied_with_one_call_per_arena_chunk_and_lands_where_its_weights_are_read():
    """The slot layout mirrors the arena's placement, so a unit copy is one ``copy_`` per chunk its host
    copies lie in (not one per weight: the host-side cost of a copy grows with the calls,
    bench/streaming.py), and after it every leaf's slot view holds exactly its host copy."""
    schedule = MODES["layer"].replace(weight_offload="stream")
    family, model = tiny_model("flux")
    plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = SegmentRunner(model, family, plan).install()
    streamer = runner.streamer
    chunks = runner.pool.weights.chunk_count
    assert len(streamer.units) == 16 and chunks > 1
    per_unit = []
    for unit in streamer.units * 2:  # every unit into each slot
        with _Copies() as counter:
            streamer._load(unit, {unit.index})
        per_unit.append(counter.copies)
        chunks_used = {leaf.master.untyped_storage().data_ptr() for leaf in unit.leaves}
        assert counter.copies == len(chunks_used) == len(unit.runs)
        for leaf in unit.leaves:
            assert leaf.owner.data_ptr() == streamer.slots[unit.slot].data_ptr() + leaf.offset
            assert torch.equal(leaf.owner.data, leaf.master)
        assert unit.nbytes <= streamer.slot_bytes
    assert max(per_unit) <= chunks and sum(per_unit) < len(per_unit) * 2  # most units: one call
    runner.close()


@pytest.mark.parametrize("case", ["layer-p0", "stride-torch-ffn-offload-attn"])
def test_a_closed_streamed_run_frees_its_model_and_host_chunks_at_once(case):
    """After ``close()`` nothing holds a streamed run's model or host pool in a reference cycle: with
    the cyclic collector off, dropping the last references frees the model and the pool with its
    arena chunks (pinned on a GPU machine, 22.5 GiB for a streamed Flux.1-dev) at once."""
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads, _, runner = one_step("flux", CASES[case])
        model, pool = weakref.ref(runner.model), weakref.ref(runner.pool)
        chunks = [weakref.ref(chunk) for chunk in pool().weights.chunks if chunk is not None]
        assert chunks and runner.streamer.stats.copies > 0
        runner.close()
        del runner, grads
        assert model() is None and pool() is None
        assert all(chunk() is None for chunk in chunks)
    finally:
        gc.enable()
