"""LoKr, LoHa and DoRA (issue 35): LoRA gradients under every checkpoint schedule and backend equal the
no-checkpoint run's, for flux, sd3 and wan, with weights streamed and over an int8 base too.

One test per adapter and family runs its cases on one prototype (``tests/helpers.py`` builds each
tiny model once): per-block, interval 2 and interval 2 stride 4 under torch and unsloth against the
fp32 run without checkpointing; an int8 base streamed under interval 2 stride 4 with unsloth (the
streamer strict: a weight read outside its use is NaN) against the int8 run without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MODES, one_step

from segmented_checkpointing.engine.config import LoraSettings

ADAPTERS = {
    "lokr": LoraSettings(rank=4, alpha=8, lora_type="lokr"),
    "loha": LoraSettings(rank=4, alpha=8, lora_type="loha"),
    "dora": LoraSettings(rank=4, alpha=8, use_dora=True, init="gaussian"),
}
CASES = [MODES[mode].replace(gradient_checkpointing_backend=backend)
         for mode in ("layer", "interval2", "interval2-stride4") for backend in ("torch", "unsloth")]
STREAMED = MODES["interval2-stride4"].replace(gradient_checkpointing_backend="unsloth", weight_offload="stream")
SMALLER = {"flux": {"num_layers": 4, "num_single_layers": 4}, "sd3": {"num_layers": 4}, "wan": {"num_layers": 4}}
"""Four blocks per list (half the presets'): stride 4 still leaves blocks 2-3 plain."""


def _worst(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert grads.keys() == reference.keys() and grads
    return max((grads[k] - reference[k]).abs().max().item() for k in grads)


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_adapter_gradients_equal_the_uncheckpointed_run(family, adapter):
    lora = ADAPTERS[adapter]
    small = SMALLER[family]
    reference = one_step(family, MODES["none"], lora=lora, **small)[0]
    assert all(reference[k].abs().sum() > 0 for k in reference), "every adapter tensor gets a gradient"
    for schedule in CASES:
        grads, _, runner = one_step(family, schedule, lora=lora, **small)
        assert _worst(grads, reference) <= 1e-6, (adapter, family, schedule.mode)
        assert runner.plan.checkpointed_blocks > 0 and not runner.stats.fallbacks
    int8 = one_step(family, MODES["none"], lora=lora, base="int8-torchao", **small)[0]
    grads, _, runner = one_step(family, STREAMED, lora=lora, base="int8-torchao", strict_streaming=True, **small)
    assert runner.streamer.stats.copies > 0 and runner.plan.streamed_blocks > 0
    assert _worst(grads, int8) <= 1e-6, (adapter, family, "int8 streamed")
    expected = {"lokr": ("lokr_w1", "lokr_w2"), "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
                "dora": ("lora_A", "lora_B", "lora_magnitude_vector")}[adapter]
    assert all(any(f".{t}." in name for name in reference) for t in expected), sorted(reference)[:4]
