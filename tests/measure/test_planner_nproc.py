"""``segckpt plan --nproc N``: per-rank peak under DDP and FSDP2 from the probe's figures, and
DDP recommended while a replica fits the budget (engine/measure/ranks.py)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import refuse_to_build_models

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.measure.costs import BlockCost
from segmented_checkpointing.engine.measure.planner import PlannerError, choose, predict
from segmented_checkpointing.engine.measure.planning import plan_for_budget
from segmented_checkpointing.engine.measure.probe import Probe
from segmented_checkpointing.engine.measure.ranks import check_nproc, rank_peaks
from segmented_checkpointing.engine.measure.runs import RunWorkspace
from segmented_checkpointing.engine.model.bundle import build_preset

NONE = CheckpointSchedule(gradient_checkpointing=False)


def _probe() -> Probe:
    """2 + 2 flux blocks: 1000 bytes of activations, 100 of LoRA and 200 of optimizer state each;
    frozen 4000 (double) and 3000 (single) bytes; peak 30000 without checkpointing."""
    blocks = {name: [BlockCost(name, i, act=1000, carried=100, fwd_s=0.01, grad=100) for i in range(2)]
              for name in ("double", "single")}
    return Probe("flux", "cuda", blocks, peak_bytes=30_000, sec_per_step=0.1, offload_s_per_tensor=0.0,
                 offload_s_per_byte=0.0, frozen_block_bytes={"double": [4000] * 2, "single": [3000] * 2},
                 h2d_s_per_byte=1e-9, optimizer_block_bytes={"double": [200] * 2, "single": [200] * 2},
                 held_bytes=20_000)


def test_both_per_rank_peaks_follow_from_the_probe_figures():
    probe_ = _probe()
    chosen = predict(probe_, NONE)
    assert chosen.peak_bytes == 30_000  # no checkpointing: the probe's own peak
    two = rank_peaks(probe_, chosen, 10**6, 2)
    # DDP: + the LoRA gradients once more (bucket buffers); FSDP2: frozen 14000 + LoRA 400 + optimizer
    # 800 held as one half, + 2 gathered double blocks (4000 frozen + 100 LoRA)
    assert (two.ddp_peak_bytes, two.fsdp_peak_bytes) == (30_000 + 400, 30_000 - 15_200 // 2 + 2 * 4100)
    four = rank_peaks(probe_, chosen, 10**6, 4)
    assert (four.ddp_peak_bytes, four.fsdp_peak_bytes) == (30_400, 30_000 - 15_200 * 3 // 4 + 8200)
    # a streamed choice: DDP streams as one process; FSDP2 refuses streaming, so its figure is resident
    streamed = predict(probe_, NONE.replace(weight_offload="stream"))
    assert streamed.peak_bytes < 30_000
    ranks = rank_peaks(probe_, streamed, 10**6, 4)
    assert (ranks.ddp_peak_bytes, ranks.fsdp_peak_bytes, ranks.fsdp_mode) == (streamed.peak_bytes + 400, 26_800, "none")
    assert rank_peaks(probe_, chosen, 10**6, 1) is None  # one process: no distributed figures
    assert "per-rank" not in choose(probe_, 10**6).render()


def test_the_recommendation_flips_to_fsdp_when_the_budget_is_between_the_two():
    probe_, chosen = _probe(), predict(_probe(), NONE)
    roomy = rank_peaks(probe_, chosen, 40_000, 4)
    assert roomy.recommended == "ddp"
    assert roomy.render() == ("4 processes, per-rank peak predicted: DDP 2.831e-05 GiB, FSDP2 2.496e-05 GiB (none); "
                              "budget 3.725e-05 GiB; recommended: --ddp (a replica fits the budget; DDP is the "
                              "faster for LoRA)")
    tight = rank_peaks(probe_, chosen, 30_000, 4)  # 95% of it, 28500, lies between FSDP2's 26800 and DDP's 30400
    assert tight.recommended == "fsdp" and tight.reason == "a replica does not fit the budget less 5% headroom"
    assert tight.to_dict()["fsdp_peak_bytes"] == 26_800 and tight.to_dict()["budget_bytes"] == 30_000
    over = rank_peaks(probe_, chosen, 20_000, 4)
    assert over.recommended == "fsdp" and "FSDP2 is predicted over it too" in over.reason


def test_nproc_0_is_refused_before_any_model_is_built(monkeypatch, capsys):
    refuse_to_build_models(monkeypatch, "--nproc was checked")
    assert cli.main(["plan", "--budget", "1", "--nproc", "0"]) == 2
    assert capsys.readouterr().err == "segckpt: error: nproc=0 is invalid: allowed an integer from 1 to 1024.\n"
    assert cli.main(["plan", "--budget", "1", "--nproc", "2", "--check"]) == 2
    assert "nproc=2 is invalid with preflight=True (--check): allowed 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"nproc=True is invalid: allowed an integer >= 1"):
        check_nproc(True, "nproc")


@pytest.mark.parametrize("value", ["1.5", "two"])
def test_a_non_integer_nproc_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["plan", "--budget", "1", "--nproc", value])
    assert caught.value.code == 2 and f"argument --nproc: invalid int value: '{value}'" in capsys.readouterr().err


def _heavy_lora_probe() -> Probe:
    """:func:`_probe` with a LoRA of 1000 bytes and 4000 bytes of optimizer state per block (peak
    50000): streaming every block leaves a replica over budgets that FSDP2 on 4 processes fits."""
    probe_ = _probe()
    for costs in probe_.blocks.values():
        for cost in costs:
            cost.grad = 1000
    return dataclasses.replace(probe_, peak_bytes=50_000, held_bytes=40_000,
                               optimizer_block_bytes={"double": [4000] * 2, "single": [4000] * 2})


def test_when_no_replica_fits_plan_chooses_for_fsdp_ranks(tmp_path):
    config = TrainConfig.create(family="flux", resolution=64, output=str(tmp_path))
    four = MeasureConfig.create(nproc=4, timing_steps=0)
    choice = plan_for_budget(RunWorkspace(config, build_preset("flux")), four, 40_000, probe_=_heavy_lora_probe())
    # FSDP2 per rank: 50000 - (frozen 14000 + LoRA 4000 + optimizer 16000) x 3/4 + 2 x (4000 + 1000)
    assert (choice.chosen.schedule.mode, choice.chosen.peak_bytes) == ("none", 34_500)
    ranks = choice.ranks  # DDP: the smallest replica (every block streamed, 44000) + the LoRA gradients
    assert (ranks.recommended, ranks.ddp_peak_bytes, ranks.fsdp_peak_bytes) == ("fsdp", 48_000, 34_500)
    assert "no schedule fits one process (budget=" in choice.render() and "FSDP2's per rank on 4" in choice.render()
    assert not any(p.schedule.streams or p.schedule.gradient_checkpointing_offload_attention
                   for p in choice.candidates)  # what fsdp refuses is not offered
    with pytest.raises(PlannerError, match=r"\(none-stream\); FSDP2 on 4 processes: budget=.* the smallest "
                                           r"predicted peak is 3.213e-05 GiB \(none\)"):
        plan_for_budget(RunWorkspace(config, build_preset("flux")), four, 36_000, probe_=_heavy_lora_probe())
    with pytest.raises(PlannerError, match=r"the smallest predicted peak is 4.098e-05 GiB \(none-stream\)$"):
        plan_for_budget(RunWorkspace(config, build_preset("flux")), four.replace(nproc=1), 40_000,
                        probe_=_heavy_lora_probe())  # one process: as before
