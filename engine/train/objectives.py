"""Training objectives: how noise is added, what the model is trained to predict, and how the loss
is weighted.

* ``flow`` (rectified flow / flow matching, Liu et al. 2022; Esser et al. 2024 "Scaling
  Rectified Flow Transformers"): ``x_t = (1 - sigma) * x0 + sigma * noise`` and the target is the
  velocity ``noise - x0``. ``u`` is drawn by diffusers'
  ``training_utils.compute_density_for_timestep_sampling`` (``timestep_sampling``: logit-normal,
  uniform or mode) and shifted to ``sigma = time_shift(mu, 1, u)`` (``flow_shift``;
  ``engine/families/shift.py``: the family's inference shift with ``auto``, resolved per latent
  shape from its image tokens). ``u`` is the noise level itself (SD3 paper, musubi-tuner,
  SimpleTuner: ``logit_mean > 0`` draws more noise).
* ``epsilon`` (DDPM, Ho et al. 2020) for PixArt-style models: ``x_t = sqrt(abar_t) x0 +
  sqrt(1 - abar_t) noise``, target ``noise``, t uniform in [0, 1000) with the scaled-linear beta
  schedule (0.0001 to 0.02) those models were trained with.

The loss is the mean squared error, per sample weighted by ``loss_weighting``: diffusers'
``compute_loss_weighting_for_sd3`` (``sigma_sqrt``, ``cosmap``) for flow families, min-SNR-gamma
(``min(SNR, gamma) / SNR`` with diffusers' ``compute_snr``, Hang et al. 2023) for epsilon ones.

Every draw comes from the run's generator (its state is part of the resumable training state): the
noise first, then the noise levels, as before ``timestep_sampling`` existed, so ``logit_normal``
(0, 1) with ``flow_shift=1`` draws what earlier releases drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3, compute_snr

from ..config.objective import ObjectiveConfig
from ..families import FamilyAdapter
from ..families.limits import token_count
from ..families.shift import FlowShift, ResolvedShift, static_shift
from ..families.timesteps import NUM_TRAIN_TIMESTEPS, alphas_cumprod

OBJECTIVES = ("flow", "epsilon")


def shift_sigmas(sigmas: torch.Tensor, resolved: ResolvedShift) -> torch.Tensor:
    """``sigmas`` ``(N,)`` in ``[0, 1]`` shifted by ``resolved``: the scheduler's own
    ``FlowMatchEulerDiscreteScheduler.time_shift(mu, 1.0, sigmas)`` of its time-shift type."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=resolved.time_shift_type)
    return scheduler.time_shift(resolved.mu, 1.0, sigmas)


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sample's mean squared error, ``(B,)`` fp32, of ``prediction`` and ``target`` (both ``(B, ...)``),
    unweighted (the loss by noise level of ``report.json`` records it detached)."""
    return (prediction.float() - target.float()).pow(2).reshape(prediction.shape[0], -1).mean(dim=1)


@dataclass
class NoiseSchedule:
    """How one run draws noise levels and weights its loss (built once by the run's set-up).

    Attributes:
        family: the family (its objective; its image tokens per latent shape).
        config: the run's objective options.
        scheduler: what the model infers with (``engine/families/shift.py`` ``scheduler_settings``);
            ``None``: nothing declared nor read (``auto`` is then no shift).
        model_config: the transformer's config (its patch sizes count the tokens).
        shifts: the resolved shift of each token count drawn so far (one per bucket and frame count).
    """

    family: FamilyAdapter
    config: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    scheduler: FlowShift | None = None
    model_config: Mapping[str, Any] = field(default_factory=dict)
    shifts: dict[int, ResolvedShift] = field(default_factory=dict)

    def shift_for(self, latent_shape: tuple[int, ...]) -> ResolvedShift | None:
        """The shift of one sample of ``latent_shape`` (``(C, h, w)`` or ``(C, F', h, w)``), cached
        per token count; ``None``: no shift (``flow_shift`` 1, or ``auto`` with nothing declared)."""
        tokens = token_count(self.family, self.model_config, tuple(latent_shape))
        if tokens not in self.shifts:
            number = self.config.shift
            if number is not None:
                resolved = static_shift(number)
            elif self.scheduler is not None:
                resolved = self.scheduler.resolve(tokens)
            else:
                resolved = static_shift(1.0)
            self.shifts[tokens] = resolved
        resolved = self.shifts[tokens]
        return None if resolved.mu == 0.0 and not resolved.dynamic else resolved

    def noisy_latents(self, latents: torch.Tensor, generator: torch.Generator, shared: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw noise and noise levels for a batch of clean latents.

        Args:
            latents: clean latents x0, ``(B, C, ...)`` on the CPU (the generator's device); one
                batch is one shape (one bucket, one frame count).
            generator: a CPU generator (its state is part of the resumable training state).
            shared: one noise level for the whole batch (models whose timestep is per batch, not
                per sample: :attr:`~..families.base.FamilyAdapter.shared_sigma`).

        Returns:
            ``(noisy latents like x0, sigmas (B,) in [0, 1], target like x0)``; for ``epsilon``
            the sigmas are ``t / 1000``.

        Raises:
            ValueError: an unknown objective.
        """
        b = latents.shape[0]
        draws = 1 if shared else b
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
        shape = (b,) + (1,) * (latents.ndim - 1)
        if self.family.objective == "flow":
            sigmas = self.draw_sigmas(draws, generator, latents.shape[1:]).expand(b).contiguous()
            s = sigmas.view(shape).to(latents.dtype)
            return (1 - s) * latents + s * noise, sigmas, noise - latents
        if self.family.objective == "epsilon":
            t = torch.randint(0, NUM_TRAIN_TIMESTEPS, (draws,), generator=generator).expand(b).contiguous()
            abar = alphas_cumprod()[t].view(shape).to(latents.dtype)
            return abar.sqrt() * latents + (1 - abar).sqrt() * noise, t.float() / NUM_TRAIN_TIMESTEPS, noise
        raise ValueError(f"objective={self.family.objective!r} is invalid: allowed {', '.join(OBJECTIVES)}")

    def draw_sigmas(self, draws: int, generator: torch.Generator, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """``draws`` flow noise levels ``(draws,)`` float32 in ``[0, 1]`` for samples of ``latent_shape``:
        diffusers' ``compute_density_for_timestep_sampling`` from ``generator``, then :meth:`shift_for`'s shift."""
        cfg = self.config
        u = compute_density_for_timestep_sampling(cfg.timestep_sampling, draws, logit_mean=cfg.logit_mean,
                                                  logit_std=cfg.logit_std, mode_scale=cfg.mode_scale, device="cpu",
                                                  generator=generator)
        resolved = self.shift_for(latent_shape)
        return u if resolved is None else shift_sigmas(u, resolved)

    def loss(self, prediction: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The batch's loss: the mean squared error of ``prediction`` and ``target`` (both like the
        latents, ``(B, ...)``), each sample's mean weighted by ``loss_weighting`` at its noise
        level ``sigmas`` ``(B,)``; ``none`` is ``F.mse_loss`` over every element (fp32)."""
        weighting = self.config.loss_weighting
        if weighting == "none":
            return F.mse_loss(prediction.float(), target.float())
        if weighting == "min_snr":
            steps = (sigmas * NUM_TRAIN_TIMESTEPS).round().long().cpu()  # sigma = t / 1000 (epsilon)
            snr = compute_snr(SimpleNamespace(alphas_cumprod=alphas_cumprod()), steps)
            weights = torch.clamp(snr, max=self.config.snr_gamma) / snr  # min(SNR, gamma) / SNR (epsilon target)
        else:
            weights = compute_loss_weighting_for_sd3(weighting, sigmas.float())
        per_sample = per_sample_mse(prediction, target)
        return (weights.to(per_sample) * per_sample).mean()

    def summary(self) -> dict[str, Any]:
        """What the run draws with, for the report: the options, the scheduler read, the shift per token count."""
        cfg = self.config
        flow = self.family.objective == "flow"
        return {"objective": self.family.objective,
                "timestep_sampling": cfg.timestep_sampling if flow else "uniform DDPM steps",
                "flow_shift": cfg.flow_shift if flow else None,
                "scheduler": None if self.scheduler is None or not flow else
                {"config": self.scheduler.describe(), "source": self.scheduler.source},
                "shifts": {str(tokens): shift.to_dict() for tokens, shift in sorted(self.shifts.items())},
                "loss_weighting": cfg.loss_weighting, "guidance_value": cfg.guidance_value}

