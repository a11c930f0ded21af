"""The recipe is visible (issue 35): the one line a run prints at its start and ``report.json``'s ``recipe``
come from one place, with the shift resolved per token count; the loss by noise level bins each sample's
unweighted error by its noise level (a tiny run's exact bins are checked in ``test_optimizers.py``)."""

from __future__ import annotations

import pytest
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from segmented_checkpointing.engine.config import LoraSettings, ObjectiveConfig, TrainConfig
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.train.objectives import NoiseSchedule
from segmented_checkpointing.engine.train.report import loss_by_noise_level, recipe_line, recipe_section


def test_the_recipe_line_and_section_of_flux_at_1024_px():
    family = get_family("flux")
    noise = NoiseSchedule(family, ObjectiveConfig(), family.flow_shift)
    noise.shifts[4096] = family.flow_shift.resolve(4096)  # 1024 px: 64 x 64 latent patches
    history = [{"clipped": True, "dropped_captions": 1}, {"clipped": False, "dropped_captions": 2}]
    recipe = _recipe(TrainConfig.create(family="flux"), noise, history, "torch.optim.adamw.AdamW")
    mu = calculate_shift(4096, 256, 4096, 0.5, 1.15)
    assert recipe["shifts"] == [{"tokens": 4096, "shift": pytest.approx(3.1582, abs=1e-4), "mu": mu,
                                 "time_shift_type": "exponential", "dynamic": True}]
    assert recipe["sampling"] == {"name": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0}
    assert recipe["clipping"] == {"max_grad_norm": 1.0, "clipped_steps": 1}
    assert recipe["caption_dropout"] == {"probability": 0.0, "dropped_captions": 3}
    assert recipe["guidance"] == {"value": 1.0, "input": True}
    assert recipe["adapter"] == {"lora_type": "lora", "use_dora": False, "rank": 16, "alpha": 16.0, "dropout": 0.0,
                                 "lokr_factor": -1, "lokr_full_matrix": False,
                                 "targets": "attention"}
    assert recipe_line(recipe) == (
        "recipe: logit_normal(0, 1), flow_shift auto (dynamic: mu 0.5 at 256 to 1.15 at 4096 tokens): 3.158 at 4096 "
        "tokens, loss none, guidance 1, clip 1, caption_dropout 0, adamw lr 0.001 wd 0, lora r16 a16 attention")


def test_the_recipe_of_an_epsilon_family_with_min_snr_and_a_lokr_on_named_modules():
    family = get_family("pixart")
    config = TrainConfig.create(family="pixart", loss_weighting="min_snr", snr_gamma=5.0, optimizer="adafactor",
                                max_grad_norm=0, caption_dropout=0.1,
                                lora=LoraSettings(rank=8, alpha=4.0, lora_type="lokr", factor=4,
                                                  target_modules=("to_q", "to_k")))
    recipe = _recipe(config, NoiseSchedule(family, config.objective))
    assert recipe["sampling"] == {"name": "uniform DDPM steps"} and recipe["shifts"] == []
    assert recipe["loss_weighting"] == {"name": "min_snr", "snr_gamma": 5.0}
    assert recipe["adapter"]["targets"] == ["to_q", "to_k"]
    assert recipe_line(recipe) == ("recipe: uniform DDPM steps, loss min_snr(gamma 5), guidance 1, clip 0, "
                                   "caption_dropout 0.1, adafactor lr 0.001 wd 0, lokr(factor 4) r8 a4 to_q,to_k")


def test_mode_sampling_a_static_shift_and_all_linear_dora():
    family = get_family("sd3")
    config = TrainConfig.create(family="sd3", timestep_sampling="mode", flow_shift="3",
                                lora=LoraSettings(use_dora=True, target_modules=("all-linear",)))
    recipe = _recipe(config, NoiseSchedule(family, config.objective, family.flow_shift))
    assert recipe["sampling"] == {"name": "mode", "mode_scale": 1.29}
    assert recipe_line(recipe).startswith("recipe: mode(1.29), flow_shift 3.0, loss none")
    assert recipe_line(recipe).endswith("lora+dora r16 a16 all-linear")


def test_loss_by_noise_level_bins_on_equal_tenths():
    history = [{"noise_levels": [0.0, 0.1, 0.95, 1.0], "sample_losses": [1.0, 2.0, 3.0, 5.0]},
               {"noise_levels": [0.15], "sample_losses": [4.0]},
               {"loss": 1.0}]  # a record of an earlier release: nothing to count
    section = loss_by_noise_level(history)
    assert section["samples"] == 5
    assert [b["count"] for b in section["bins"]] == [1, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    assert [b["mean_loss"] for b in section["bins"]] == [1.0, 3.0] + [None] * 7 + [4.0]
    assert (section["bins"][1]["low"], section["bins"][1]["high"]) == (0.1, 0.2)


def _recipe(config, noise, history=None, optimizer_class=None):
    """:func:`recipe_section` of ``config``'s components."""
    return recipe_section(config.objective, config.optimizer, config.lora, config.data.caption_dropout, noise,
                          history, optimizer_class)
