"""Generic fallback: a diffusers model without a family adapter (CogView4 here; Chroma's class
stands in for a loop that changes state between blocks)."""

from __future__ import annotations

import copy

import diffusers
import pytest
import torch
from helpers import MODES

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.core.generic import probe_family
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.model.lora_files import add_lora


def _lora(model, targets=("to_q", "to_k", "to_v")):
    torch.manual_seed(0)
    add_lora(model, LoraSettings(rank=4, alpha=8, init="gaussian"), targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _cogview4():
    torch.manual_seed(0)
    model = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=6, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=32, time_embed_dim=32, condition_dim=8, pos_embed_max_size=16, sample_size=16,
        rope_axes_dim=(8, 8))
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g),
        "timestep": torch.tensor([100.0, 700.0]),
        "original_size": torch.tensor([[64.0, 64.0]] * 2), "target_size": torch.tensor([[64.0, 64.0]] * 2),
        "crop_coords": torch.zeros(2, 2), "return_dict": False,
    }
    return _lora(model), inputs


def _step(model, adapter, inputs, schedule):
    model = copy.deepcopy(model)
    plan = effective_plan(adapter, schedule, count_blocks(adapter, model), warn=False)
    runner = SegmentRunner(model, adapter, plan).install()
    calls: dict[int, int] = {}
    for i, block in enumerate(adapter.blocks(model, adapter.block_lists[0])):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    output = runner.forward(**inputs)[0]
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, calls, runner


def test_probe_proves_segments_for_a_model_without_adapter():
    model, inputs = _cogview4()
    adapter = probe_family(copy.deepcopy(model), inputs)
    assert adapter.name == "generic:CogView4Transformer2DModel" and adapter.segmented
    (block_list,) = adapter.block_lists
    assert block_list.attr == "transformer_blocks"
    assert set(block_list.carry.links) == {(0, 0), (1, 1)}  # blocks return (hidden, encoder)
    reference, _, _ = _step(model, adapter, inputs, MODES["none"])
    for mode in ("layer", "interval2", "interval2-stride4"):
        grads, calls, runner = _step(model, adapter, inputs, MODES[mode])
        worst = max((grads[k] - reference[k]).abs().max().item() for k in reference)
        assert worst <= 1e-6, (mode, worst)
        plan = runner.plan
        assert "segments proven by a one-step probe" in plan.notes[0]
        checkpointed = set(plan.lists[0].checkpointed)
        assert calls == {i: 2 if i in checkpointed else 1 for i in range(6)}
        assert not runner.stats.fallbacks and runner.stats.undeclared_calls == 0
        assert "generic fallback: segments proven" in plan.render()


def test_probe_keeps_a_state_changing_loop_per_block():
    from segmented_checkpointing.engine.families import get_family

    chroma = get_family("chroma")  # its loop slices a different modulation per block
    torch.manual_seed(0)
    model = _lora(chroma.model_cls()(**chroma.tiny_config))
    from helpers import random_batch

    latents, sigmas, text = random_batch(chroma, model)
    inputs = chroma.make_inputs(model, latents, sigmas, text)
    adapter = probe_family(copy.deepcopy(model), inputs)
    assert not adapter.segmented
    assert "per-block checkpointing only" in adapter.plan_notes[0] and "changes between blocks" in adapter.plan_notes[0]
    with pytest.warns(UserWarning, match="interval"):
        plan = effective_plan(adapter, MODES["interval2"], count_blocks(adapter, model))
    assert all(len(p.segments) == p.num_blocks for p in plan.lists)


def test_model_without_checkpointing_support_is_refused():
    model = diffusers.TransformerTemporalModel(num_attention_heads=2, attention_head_dim=8, in_channels=16,
                                               norm_num_groups=4, num_layers=1)
    with pytest.raises(ValueError, match="TransformerTemporalModel does not support gradient checkpointing"):
        probe_family(model, {"hidden_states": torch.randn(2, 16, 4, 4), "num_frames": 2, "return_dict": False})


def test_unet2d_down_blocks_are_probed_per_list():
    """UNet2DModel checkpoints each resnet of each block's list: one list per nn.ModuleList."""
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 8),
                                  down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                                  layers_per_block=2, norm_num_groups=4)
    adapter = probe_family(model, {"sample": torch.randn(1, 3, 8, 8), "timestep": 1, "return_dict": False})
    assert {bl.attr for bl in adapter.block_lists} >= {"down_blocks.0.resnets", "down_blocks.1.resnets"}
    # up blocks concatenate a skip tensor onto the hidden state between resnets: caught by discovery
    assert not adapter.segmented
    assert "'up_blocks.0.resnets': argument 0 changes between blocks 0 and 1" in adapter.plan_notes[0]
    assert "down_blocks" not in adapter.plan_notes[0]


def test_the_probe_takes_the_models_default_outputs():
    """Without ``return_dict=False`` the model returns its ``BaseOutput``: the probe reads it."""
    model, inputs = _cogview4()
    defaults = {k: v for k, v in inputs.items() if k != "return_dict"}
    adapter = probe_family(copy.deepcopy(model), defaults)
    assert adapter.segmented and adapter.block_lists == probe_family(copy.deepcopy(model), inputs).block_lists
