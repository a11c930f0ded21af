"""The noise schedule: draws match diffusers' reference distributions, ``flow_shift=auto`` is the shift each
family's pipeline computes for inference, loss weights and guidance are diffusers' and the pipelines', a
model folder's scheduler config is read, and gradients still equal the no-checkpoint run's under every option."""

from __future__ import annotations

import inspect
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_mu
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift as ltx_mu
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as qwen_mu
from diffusers.training_utils import compute_density_for_timestep_sampling
from helpers import MODES, random_batch, refuse_to_build_models, tiny_model

from segmented_checkpointing.engine.config import ConfigError, ObjectiveConfig, TrainConfig
from segmented_checkpointing.engine.config.backends import BACKENDS
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.families.conditioning import guided_inputs
from segmented_checkpointing.engine.families.limits import full_config
from segmented_checkpointing.engine.families.registry import family_names
from segmented_checkpointing.engine.families.scheduler_config import SchedulerConfigError, scheduler_settings
from segmented_checkpointing.engine.families.shift import FlowShift
from segmented_checkpointing.engine.families.timesteps import alphas_cumprod
from segmented_checkpointing.engine.model.bundle import ModelLoadError
from segmented_checkpointing.engine.model.folders import load_model_folder
from segmented_checkpointing.engine.train.objectives import NoiseSchedule, shift_sigmas
from segmented_checkpointing.engine.train.previews import preview_scheduler

DRAWS = 100_000
FLUX_CONFIG = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
               "max_image_seq_len": 4096, "shift": 3.0}
"""black-forest-labs/FLUX.1-dev's scheduler config, written out for the reference."""


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = a.double().sort().values, b.double().sort().values
    both = torch.cat([a, b])
    return (torch.searchsorted(a, both, right=True) / len(a) - torch.searchsorted(b, both, right=True) / len(b)
            ).abs().max().item()


def _reference(scheme: str, scheduler: FlowMatchEulerDiscreteScheduler, mu: float | None) -> torch.Tensor:
    """DRAWS noise levels built from diffusers alone: its density draw, then the scheduler's own shift of them."""
    u = compute_density_for_timestep_sampling(scheme, DRAWS, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=torch.Generator().manual_seed(1234))
    scheduler.set_timesteps(sigmas=u.numpy(), mu=mu)
    return scheduler.sigmas[:-1]


@pytest.mark.parametrize("scheme", ["logit_normal", "uniform", "mode"])
@pytest.mark.parametrize("shift, pixels", [("1", 512), ("3", 512), ("auto", 512), ("auto", 1024)])
def test_draws_match_diffusers_reference_distribution(scheme, shift, pixels):
    flux = get_family("flux")
    noise = NoiseSchedule(flux, ObjectiveConfig(timestep_sampling=scheme, flow_shift=shift), flux.flow_shift,
                          {"patch_size": 1})
    drawn = noise.draw_sigmas(DRAWS, torch.Generator().manual_seed(7), (16, pixels // 8, pixels // 8))
    if shift == "auto":  # FluxPipeline: mu of the packed tokens, (H / 16) x (W / 16)
        mu = flux_mu((pixels // 16) ** 2, 256, 4096, 0.5, 1.15)
        reference, s = _reference(scheme, FlowMatchEulerDiscreteScheduler(**FLUX_CONFIG), mu), math.exp(mu)
    else:
        reference, s = _reference(scheme, FlowMatchEulerDiscreteScheduler(shift=float(shift)), None), float(shift)
    assert drawn.shape == (DRAWS,) and 0 <= drawn.min() and drawn.max() <= 1
    assert _ks(drawn, reference) <= 0.01
    if scheme == "logit_normal":  # the shift moves the median 0.5 to s / (s + 1): Flux at 1024 px to 0.76
        assert drawn.median().item() == pytest.approx(s / (s + 1), abs=0.01)


def test_flow_shift_1_draws_what_earlier_releases_drew():
    """logit-normal(0, 1) unshifted is the earlier objective bit for bit (noise first, then sigmoid(randn))."""
    latents = torch.randn(3, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    noise = NoiseSchedule(get_family("flux"), ObjectiveConfig(flow_shift=1), model_config={"patch_size": 1})
    noisy, sigmas, target = noise.noisy_latents(latents, torch.Generator().manual_seed(3))
    old = torch.Generator().manual_seed(3)
    old_noise = torch.randn(latents.shape, generator=old)
    old_sigmas = torch.sigmoid(torch.randn(3, generator=old))
    s = old_sigmas.view(3, 1, 1, 1)
    assert torch.equal(sigmas, old_sigmas) and torch.equal(target, old_noise - latents)
    assert torch.equal(noisy, (1 - s) * latents + s * old_noise)


# family: (latent channels, pixels per latent cell, pixel frames per latent frame; None: an image family)
SPECS = {"flux": (16, 8, None), "flux2": (32, 8, None), "qwenimage": (16, 8, None), "sd3": (16, 8, None),
         "zimage": (16, 8, None), "lumina2": (16, 8, None), "sana": (32, 32, None), "wan": (16, 8, 4),
         "hunyuanvideo": (16, 8, 4), "ltxvideo": (128, 32, 8), "ideogram4": (32, 8, None)}
RESOLVED = {  # the shift each resolves to at 512 and 1024 px (video: 480 x 832, 81 frames), to 4 places
    "flux": (1.8776, 3.1582), "flux2": (5.4847, 7.5636), "qwenimage": (1.7138, 2.0008), "sd3": (3.0, 3.0),
    "zimage": (3.0, 3.0), "lumina2": (6.0, 6.0), "sana": (3.0, 3.0), "wan": (3.0,), "hunyuanvideo": (7.0,),
    "ltxvideo": (8.3267,), "ideogram4": (1.0, 2.0)}


def _pipeline_sigmas(name: str, height: int, width: int, frames: int, steps: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """``(unshifted, shifted)`` inference sigmas of the family's pipeline at that size, from its scheduler
    built of the released config and its own mu function (the oracle; terminal stretch left out: it
    fixes the last inference step, the training draws are not stretched)."""
    grid = np.linspace(1.0, 1 / steps, steps)
    if name in ("wan", "sana"):  # UniPC / DPM-Solver with flow sigmas: their static flow_shift
        kind = UniPCMultistepScheduler if name == "wan" else DPMSolverMultistepScheduler
        out = []
        for shift in (1.0, 3.0):
            scheduler = kind(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
            scheduler.set_timesteps(steps)
            out.append(scheduler.sigmas[:-1].numpy())
        return out[0], out[1]
    if name == "ideogram4":  # its logit-normal quantile sigmas around the resolution's mu (the clamped first left out)
        mu = _resolution_aware_mu(height=height, width=width, base_mu=0.0)
        return (_logit_normal_sigmas(steps, 0.0, std=1.0)[1:].double().numpy(),
                _logit_normal_sigmas(steps, mu, std=1.0)[1:].double().numpy())
    static = {"sd3": 3.0, "zimage": 3.0, "lumina2": 6.0, "hunyuanvideo": 7.0}
    if name in static:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=static[name])
        scheduler.set_timesteps(sigmas=grid)
        return grid, scheduler.sigmas[:-1].numpy()
    tokens = (height // 16) * (width // 16)  # Flux, Flux.2, Qwen-Image: 2x2-packed latents of an 8x VAE
    config, mu = {**FLUX_CONFIG}, None
    if name == "flux":
        mu = flux_mu(tokens, 256, 4096, 0.5, 1.15)
    elif name == "flux2":
        mu = compute_empirical_mu(tokens, 50)  # Flux2Pipeline's default num_inference_steps
    elif name == "qwenimage":
        config = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9, "max_image_seq_len": 8192}
        mu = qwen_mu(tokens, 256, 8192, 0.5, 0.9)
    elif name == "ltxvideo":  # LTXPipeline: latent frames x latent height x latent width (32x VAE, 8 frames)
        config = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024}
        mu = ltx_mu(((frames - 1) // 8 + 1) * (height // 32) * (width // 32), 1024, 4096, 0.95, 2.05)
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(sigmas=grid, mu=mu)
    return grid, scheduler.sigmas[:-1].numpy()


@pytest.mark.parametrize("name", list(SPECS))
def test_auto_shift_is_what_the_familys_pipeline_computes_for_inference(name):
    family = get_family(name)
    channels, down, per_frame = SPECS[name]
    noise = NoiseSchedule(family, ObjectiveConfig(), family.flow_shift, full_config(family.model_cls(), {}))
    sizes = [(480, 832, 81)] if per_frame else [(512, 512, 1), (1024, 1024, 1)]
    for (height, width, frames), expected in zip(sizes, RESOLVED[name], strict=True):
        latent = (channels, height // down, width // down)
        if family.video_latents:
            latent = (channels, (frames - 1) // per_frame + 1 if per_frame else 1, *latent[1:])
        resolved = noise.shift_for(latent)
        unshifted, oracle = _pipeline_sigmas(name, height, width, frames)
        ours = shift_sigmas(torch.from_numpy(unshifted.astype(np.float32)), resolved).numpy()
        np.testing.assert_allclose(ours, oracle, rtol=0, atol=2e-6)
        assert resolved.shift == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("name", family_names())
def test_every_flow_familys_declared_shift_resolves_through_diffusers(name):
    """Each declared mu rule exists in the installed diffusers and gives a finite shift >= 1 at 1024 tokens."""
    shift = get_family(name).flow_shift
    if shift is None:
        pytest.skip(f"{name} is an epsilon family")
    resolved = shift.resolve(1024)
    assert math.isfinite(resolved.mu) and resolved.shift >= 1.0 and shift.describe()


def test_buckets_and_frame_counts_get_their_own_shift():
    flux, ltx = get_family("flux"), get_family("ltxvideo")
    noise = NoiseSchedule(flux, ObjectiveConfig(), flux.flow_shift, {"patch_size": 1})
    wide, tall, square = (noise.shift_for((16, 64, 128)), noise.shift_for((16, 128, 64)), noise.shift_for((16, 64, 64)))
    assert wide == tall != square and wide.tokens == 2048 and sorted(noise.shifts) == [1024, 2048]
    video = NoiseSchedule(ltx, ObjectiveConfig(), ltx.flow_shift, {"patch_size": 1, "patch_size_t": 1})
    assert video.shift_for((128, 11, 15, 26)).mu == pytest.approx(ltx_mu(4290, 1024, 4096, 0.95, 2.05))
    assert video.shift_for((128, 3, 15, 26)).mu == pytest.approx(ltx_mu(1170, 1024, 4096, 0.95, 2.05))


def test_flow_shift_defaults_are_the_schedulers_own():
    """Keys a scheduler config file leaves out take FlowMatchEulerDiscreteScheduler's defaults."""
    defaults = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters
    for key in ("shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
                "max_image_seq_len", "time_shift_type", "shift_terminal"):
        assert getattr(FlowShift(), key) == defaults[key].default, key


def test_a_model_folders_scheduler_config_replaces_the_declared_one(tmp_path):
    flux = get_family("flux")
    (tmp_path / "scheduler").mkdir()
    assert scheduler_settings(flux.flow_shift, tmp_path) is None  # no file: the declared config applies
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "flow_shift": 5.0, "use_flow_sigmas": True}))
    read = scheduler_settings(get_family("wan").flow_shift, tmp_path)
    assert (read.shift, read.use_dynamic_shifting, read.source) == (5.0, False, str(tmp_path / "scheduler" /
                                                                                    "scheduler_config.json"))
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({"use_dynamic_shifting": True}))
    read = scheduler_settings(flux.flow_shift, tmp_path)  # the missing keys are the scheduler's, the rule Flux's
    assert (read.shift, read.max_shift, read.mu_rule) == (1.0, 1.15, flux.flow_shift.mu_rule)
    assert read.resolve(4096).mu == pytest.approx(1.15)


def test_a_damaged_scheduler_config_is_named_before_any_weight_is_read(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text('{"shift": "three"}')
    with pytest.raises(ModelLoadError, match=r"scheduler_config.json: shift='three' is invalid"):
        load_model_folder(tmp_path, "flux")  # the transformer folder holds no weights: they were never reached
    (tmp_path / "scheduler" / "scheduler_config.json").write_text("not json")
    with pytest.raises(SchedulerConfigError, match="could not be read as JSON"):
        scheduler_settings(None, tmp_path)


def test_loss_weights_are_the_formulas_of_their_sources():
    latents = torch.randn(4, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    prediction = torch.randn(4, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    per_sample = (prediction - latents).pow(2).mean(dim=(1, 2, 3))
    sigmas = torch.tensor([0.1, 0.4, 0.6, 0.95])
    flux = get_family("flux")
    assert torch.equal(NoiseSchedule(flux).loss(prediction, latents, sigmas),
                       torch.nn.functional.mse_loss(prediction, latents))
    cosmap = 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))  # SD3 paper, eq. 20's weight
    for weighting, weights in (("sigma_sqrt", sigmas ** -2), ("cosmap", cosmap)):
        loss = NoiseSchedule(flux, ObjectiveConfig(loss_weighting=weighting)).loss(prediction, latents, sigmas)
        assert loss.item() == pytest.approx((weights * per_sample).mean().item(), rel=1e-6)
    steps = torch.tensor([10, 200, 500, 900])
    abar = alphas_cumprod()[steps]
    snr = abar / (1 - abar)  # Hang et al. 2023: min(SNR, gamma) / SNR for an epsilon target
    loss = NoiseSchedule(get_family("pixart"), ObjectiveConfig(loss_weighting="min_snr", snr_gamma=5.0)).loss(
        prediction, latents, steps / 1000)
    assert loss.item() == pytest.approx((snr.clamp(max=5.0) / snr * per_sample).mean().item(), rel=1e-5)


class _Config(dict):
    """A model config read both ways (``cfg["key"]`` and ``cfg.key``), as diffusers' ``FrozenDict``."""

    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("name, guidance, expected", [("flux", 3.5, 3.5), ("hunyuanvideo", 3.5, 3500.0),
                                                      ("flux2", 1.0, 1.0)])
def test_guidance_reaches_the_model_scaled_as_its_pipeline_scales_it(name, guidance, expected):
    family = get_family(name)
    model = SimpleNamespace(config=_Config({**family.tiny_config, "guidance_embeds": True}))
    latents, _, text = random_batch(family, model, size=4)
    inputs = guided_inputs(family, model, latents, torch.full((2,), 0.5), text, guidance)
    assert inputs["guidance"].tolist() == [expected, expected]


@pytest.mark.parametrize("changes, message", [
    ({"family": "sd3", "guidance_value": 3.5}, "guidance_value=3.5 is invalid for family 'sd3': allowed 1"),
    ({"family": "pixart", "flow_shift": 3}, "flow_shift='3.0' is invalid for family 'pixart': allowed auto"),
    ({"family": "pixart", "timestep_sampling": "mode"}, "timestep_sampling='mode' is invalid for family 'pixart'"),
    ({"family": "pixart", "logit_mean": 1.0}, "logit_mean=1.0 is invalid for family 'pixart': allowed 0.0"),
    ({"family": "pixart", "loss_weighting": "cosmap"}, "loss_weighting='cosmap' is invalid for family 'pixart'"),
    ({"family": "flux", "loss_weighting": "min_snr"}, "allowed none, sigma_sqrt, cosmap"),
    ({"flow_shift": "three"}, "flow_shift='three' is invalid: allowed auto"),
    ({"flow_shift": 0}, "flow_shift=0 is invalid"),
    ({"mode_scale": 2.0}, "mode_scale=2.0 is invalid: allowed a finite number from -1 to 1.75"),
])
def test_objective_options_the_family_cannot_take_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        TrainConfig.create(**changes)
    assert "\n" not in str(error.value)


def test_guidance_on_a_model_without_a_guidance_embedder_is_refused_before_it_is_built(tmp_path, monkeypatch):
    from segmented_checkpointing.engine.train.loop import TrainingRun

    refuse_to_build_models(monkeypatch, "the guidance check")
    config = TrainConfig.create(family="flux", guidance_value=3.5, output=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"guidance_value=3.5 is invalid for this flux model \(tiny preset\)"):
        TrainingRun(config, log=lambda line: None)  # the tiny Flux config is schnell-like: guidance_embeds false


def test_previews_sample_the_pipelines_own_schedule():
    grid = np.linspace(1.0, 1 / 8, 8)
    flux = FlowMatchEulerDiscreteScheduler(**FLUX_CONFIG)
    flux.set_timesteps(sigmas=grid, mu=flux_mu(4096, 256, 4096, 0.5, 1.15))
    assert torch.allclose(preview_scheduler(get_family("flux").flow_shift, 8, lambda: 4096).sigmas, flux.sigmas)
    qwen = preview_scheduler(get_family("qwenimage").flow_shift, 8, lambda: 4096)
    assert qwen.sigmas[-2].item() == pytest.approx(0.02)  # its terminal stretch, as inference ends
    assert torch.equal(preview_scheduler(None, 8, lambda: 0).sigmas[:-1], torch.from_numpy(grid).float())


def _grads(family_name: str, schedule, objective: ObjectiveConfig, **overrides) -> dict[str, torch.Tensor]:
    """One training step's LoRA gradients under ``schedule``: the run's noise draw, guidance and loss."""
    family, model = tiny_model(family_name, **overrides)
    latents, _, text = random_batch(family, model)
    noise = NoiseSchedule(family, objective, family.flow_shift, dict(model.config))
    noisy, sigmas, target = noise.noisy_latents(latents, torch.Generator().manual_seed(5), family.shared_sigma)
    runner = SegmentRunner(model, family, effective_plan(family, schedule, count_blocks(family, model),
                                                         warn=False)).install()
    output = runner.forward(**guided_inputs(family, model, noisy, sigmas, text, objective.guidance_value))
    noise.loss(family.read_output(model, output, noisy), target, sigmas).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


FLUX_GUIDED = {"guidance_embeds": True, "num_layers": 4, "num_single_layers": 4}
EVERY_OPTION = ObjectiveConfig(timestep_sampling="mode", flow_shift="3", loss_weighting="cosmap", guidance_value=3.5)
SCHEDULES = [(mode, backend) for mode in ("layer", "interval2", "interval3", "interval2-stride4")
             for backend in BACKENDS]


@pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.core.offload.PinnedMemoryWarning")
def test_gradients_equal_no_checkpointing_under_every_option_schedule_and_backend():
    cases = [("flux", EVERY_OPTION, SCHEDULES),
             ("flux", ObjectiveConfig(), [("interval2-stride4", "torch"), ("layer", "unsloth-ffn")]),
             ("flux", ObjectiveConfig(timestep_sampling="uniform", flow_shift="1", loss_weighting="sigma_sqrt",
                                      guidance_value=0.0), [("interval2-stride4", "unsloth"), ("interval3", "torch-ffn")]),
             ("pixart", ObjectiveConfig(loss_weighting="min_snr"), [("layer", "torch"), ("interval2-stride4", "unsloth")])]
    for family, objective, schedules in cases:
        overrides = FLUX_GUIDED if family == "flux" else {}
        reference = _grads(family, MODES["none"], objective, **overrides)
        assert reference and any(g.abs().sum() > 0 for g in reference.values())
        for mode, backend in schedules:
            grads = _grads(family, MODES[mode].replace(gradient_checkpointing_backend=backend), objective, **overrides)
            worst = max((grads[k] - reference[k]).abs().max().item() for k in reference)
            assert worst <= 1e-6, (family, objective, mode, backend, worst)
    unguided = _grads("flux", MODES["none"], ObjectiveConfig(timestep_sampling="mode", flow_shift="3",
                                                             loss_weighting="cosmap"), **FLUX_GUIDED)
    reference = _grads("flux", MODES["none"], EVERY_OPTION, **FLUX_GUIDED)
    assert any(not torch.equal(unguided[k], reference[k]) for k in reference)  # the guidance value reached the model
