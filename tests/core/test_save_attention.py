"""gradient_checkpointing_save_attention: checkpointed regions keep their attention outputs (selective
checkpointing), so backward runs no attention kernel again; gradients equal plain recompute and no
checkpointing, the memory held between forward and backward grows by the saved outputs' bytes
(within 5%; nothing on the device with unsloth, which offloads them) and the tracked peak by no more."""

from __future__ import annotations

import pytest
import torch
from helpers import MODES, random_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from segmented_checkpointing.engine.config import ConfigError, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule, ScheduleError
from segmented_checkpointing.engine.core.attention_saving import ATTENTION_OPS
from segmented_checkpointing.engine.core.memory import LiveTensorTracker
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import family_names

FAMILIES = ("flux", "sd3", "wan", "qwenimage")
BASES = {"per-block": MODES["layer"], "interval2": MODES["interval2"], "interval2-stride4": MODES["interval2-stride4"]}


class _CountAttention(TorchDispatchMode):
    """Counts the fused attention kernels that run."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_OPS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _step(family_name, schedule):
    """One forward + backward: LoRA grads, fused attention calls in backward, bytes held after
    forward (device side: the host pool excluded), the runner."""
    family, model = tiny_model(family_name)
    latents, sigmas, text = random_batch(family, model)
    runner = SegmentRunner(model, family, effective_plan(family, schedule, count_blocks(family, model),
                                                         warn=False)).install()
    tracker = LiveTensorTracker(exclude=runner.pool.is_host if runner.pool else None)
    torch.manual_seed(123)
    with tracker:
        output = runner.forward(**family.make_inputs(model, latents, sigmas, text))
        loss = (family.read_output(model, output, latents).float() - latents).pow(2).mean()
        held = tracker.current_bytes
        counting = _CountAttention()
        with counting:
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, counting.calls, (held, tracker.peak_bytes), runner


def _saving(schedule):
    return CheckpointSchedule.from_config({**schedule.to_dict(), "gradient_checkpointing_save_attention": True})


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_attention_gives_the_gradients_of_no_checkpointing_and_runs_no_attention_in_backward(family):
    reference, _, _, _ = _step(family, MODES["none"])
    for name, base in BASES.items():
        for backend in ("torch", "unsloth"):
            plain = CheckpointSchedule.from_config({**base.to_dict(), "gradient_checkpointing_backend": backend})
            grads_plain, calls_plain, (held_plain, peak_plain), _ = _step(family, plain)
            grads, calls, (held, peak), runner = _step(family, _saving(plain))
            for got in (grads, grads_plain):
                assert max((got[k] - reference[k]).abs().max().item() for k in reference) <= 1e-6, (name, backend)
            assert calls_plain > 0 and calls == 0, (name, backend, calls_plain, calls)  # attention recomputed: never
            stats = runner.saving.stats
            assert stats.saved_outputs > 0 and stats.recomputed_calls == 0 and stats.unsaved_regions == 0
            # the memory held between forward and backward grows by the saved outputs (torch), or not at
            # all on the device side (unsloth: they went to host memory with the boundary inputs)
            extra = stats.saved_bytes if backend == "torch" else 0
            assert abs(held - held_plain - extra) <= 0.05 * stats.saved_bytes, (name, backend, held - held_plain)
            assert 0 <= peak - peak_plain <= 1.05 * extra, (name, backend, peak - peak_plain)  # never more than kept


def test_the_math_path_saves_nothing_and_says_so():
    from segmented_checkpointing.engine.model.attention_kernels import sdpa_context

    with sdpa_context(("math",)):
        _, _, _, runner = _step("flux", _saving(MODES["layer"]))
    stats = runner.saving.stats
    assert stats.saved_outputs == 0 and stats.unsaved_regions > 0  # counted, no saving claimed


def test_the_plan_marks_blocks_that_keep_attention():
    family, model = tiny_model("wan")
    for backend, mark in (("torch", "K"), ("unsloth", "k")):
        schedule = _saving(CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
                                              gradient_checkpointing_backend=backend))
        plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
        assert plan.block_maps() == {"blocks": f"{mark * 2}..{mark * 2}.."}
        assert schedule.mode.endswith("-save-attn") or "-save-attn" in schedule.mode


def test_save_attention_is_refused_where_nothing_holds_attention():
    with pytest.raises(ScheduleError, match=r"gradient_checkpointing_save_attention=True is invalid with "
                                            r"gradient_checkpointing=False"):
        CheckpointSchedule(gradient_checkpointing=False, gradient_checkpointing_save_attention=True)
    with pytest.raises(ScheduleError, match=r"gradient_checkpointing_backend='torch-ffn' \(its FFN-only regions"):
        CheckpointSchedule(gradient_checkpointing_backend="torch-ffn", gradient_checkpointing_save_attention=True)
    with pytest.raises(ConfigError, match="fsdp_activation_checkpointing=True: allowed false"):
        TrainConfig.create(fsdp=True, fsdp_activation_checkpointing=True, gradient_checkpointing_save_attention=True)


@pytest.mark.parametrize("family", family_names())
def test_every_family_keeps_its_attention_outputs(family):
    """docs/FAMILIES.md's claim: every family's attention is a fused SDPA call (the regions of its lists
    that hold attention save outputs, none saves nothing)."""
    _, calls, _, runner = _step(family, _saving(MODES["layer"]))
    stats = runner.saving.stats
    assert stats.saved_outputs > 0 and stats.unsaved_regions == 0 and calls == 0


@pytest.mark.parametrize("changes", [{"weight_offload": "stream"}, {"base_model_precision": "int8-torchao"}],
                         ids=["weights streamed", "int8 base"])
def test_saved_attention_composes_with_streaming_and_a_quantized_base(tmp_path, changes):
    """Through the trainer: the runs with and without kept attention outputs give the same losses and LoRA."""
    from safetensors.torch import load_file

    from segmented_checkpointing.engine.config import LoraSettings
    from segmented_checkpointing.engine.train.loop import train

    if "base_model_precision" in changes:
        pytest.importorskip("torchao")
    results = {}
    for save in (False, True):
        schedule = CheckpointSchedule.from_config({"weight_offload": changes.get("weight_offload", "none"),
                                                   "gradient_checkpointing_save_attention": save})
        config = TrainConfig.create(resolution=32, steps=2, lora=LoraSettings(rank=2, alpha=2.0), schedule=schedule,
                                    output=str(tmp_path / str(save)), timing_warmup_steps=0,
                                    **{k: v for k, v in changes.items() if k != "weight_offload"})
        results[save] = train(config, log=lambda line: None)
    assert results[True].report["steps"][0]["saved_attention_outputs"] > 0
    assert [h["loss"] for h in results[True].history] == pytest.approx([h["loss"] for h in results[False].history],
                                                                        abs=1e-6)
    a, b = load_file(results[True].lora_path), load_file(results[False].lora_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_the_plan_route_reads_save_attention_as_the_strip_sends_it():
    """The node's block strip sends widget values as query strings (``true`` / ``false``)."""
    from segmented_checkpointing.engine.core.plan_query import plan_for_query

    on = plan_for_query({"family": "wan", "size": "tiny", "gradient_checkpointing_save_attention": "true"})
    off = plan_for_query({"family": "wan", "size": "tiny", "gradient_checkpointing_save_attention": "false"})
    assert on["block_map"] == {"blocks": "K" * 8} and off["block_map"] == {"blocks": "C" * 8}
