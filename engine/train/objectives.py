"""Training objectives: how noise is added and what the model is trained to predict.

* ``flow`` (rectified flow / flow matching, Liu et al. 2022; Esser et al. 2024 "Scaling
  Rectified Flow Transformers"): ``x_t = (1 - sigma) * x0 + sigma * noise`` and the target is the
  velocity ``noise - x0``; ``sigma = sigmoid(n)``, ``n ~ N(0, 1)`` (logit-normal sampling, as in
  the SD3 paper).
* ``epsilon`` (DDPM, Ho et al. 2020) for PixArt-style models: ``x_t = sqrt(abar_t) x0 +
  sqrt(1 - abar_t) noise``, target ``noise``, t uniform in [0, 1000) with the scaled-linear beta
  schedule (0.0001 to 0.02) those models were trained with.
"""

from __future__ import annotations

import torch

from ..families.timesteps import NUM_TRAIN_TIMESTEPS, alphas_cumprod

OBJECTIVES = ("flow", "epsilon")


def noisy_latents(objective: str, latents: torch.Tensor, generator: torch.Generator, shared: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw noise and timesteps for a batch of clean latents.

    Args:
        objective: ``flow`` or ``epsilon``.
        latents: clean latents x0, ``(B, C, ...)`` on the CPU (the generator's device).
        generator: a CPU generator (its state is part of the resumable training state).
        shared: one noise level for the whole batch (models whose timestep is per batch, not
            per sample: :attr:`~..families.base.FamilyAdapter.shared_sigma`).

    Returns:
        ``(noisy latents like x0, sigmas (B,) in [0, 1), target like x0)``; for ``epsilon``
        the sigmas are ``t / 1000``.

    Raises:
        ValueError: unknown objective.
    """
    b = latents.shape[0]
    draws = 1 if shared else b
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
    shape = (b,) + (1,) * (latents.ndim - 1)
    if objective == "flow":
        sigmas = torch.sigmoid(torch.randn(draws, generator=generator)).expand(b).contiguous()
        s = sigmas.view(shape).to(latents.dtype)
        return (1 - s) * latents + s * noise, sigmas, noise - latents
    if objective == "epsilon":
        t = torch.randint(0, NUM_TRAIN_TIMESTEPS, (draws,), generator=generator).expand(b).contiguous()
        abar = alphas_cumprod()[t].view(shape).to(latents.dtype)
        return abar.sqrt() * latents + (1 - abar).sqrt() * noise, t.float() / NUM_TRAIN_TIMESTEPS, noise
    raise ValueError(f"objective={objective!r} is invalid: allowed {', '.join(OBJECTIVES)}")
