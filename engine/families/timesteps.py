"""Timestep conventions the family adapters share: noise level to model timestep, DDPM schedule.

The engine draws a noise level ``sigma`` in ``[0, 1)`` (engine/train/objectives.py); diffusers
schedulers count ``NUM_TRAIN_TIMESTEPS`` training steps, so a pipeline passes its transformer
``timestep = sigma * 1000`` (:func:`scheduler_timesteps`) or, for DDPM models, the integer step
(:func:`ddpm_timesteps`). Families whose model scales sigma itself pass sigma unchanged.
"""

from __future__ import annotations

from .lazy import torch

NUM_TRAIN_TIMESTEPS = 1000
"""Training steps of the diffusers schedulers (their ``num_train_timesteps`` default)."""


def scheduler_timesteps(sigmas: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The timestep a diffusers pipeline passes its model at noise level ``sigmas``.

    Rule: ``timestep = sigma * num_train_timesteps`` (1000), as
    ``FlowMatchEulerDiscreteScheduler.set_timesteps`` builds its timesteps from its sigmas
    (``diffusers/schedulers/scheduling_flow_match_euler_discrete.py``); for the epsilon objective
    it inverts ``sigma = t / 1000`` as a float.

    Args:
        sigmas: noise levels ``(B,)`` in ``[0, 1)``.
        dtype: dtype of the result (the latents'); ``sigmas`` are cast before scaling.

    Returns:
        ``(B,)`` floating timesteps in ``[0, 1000)``.
    """
    return sigmas.to(dtype) * NUM_TRAIN_TIMESTEPS


def ddpm_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """The integer DDPM step of noise level ``sigmas``: ``round(sigma * 1000)`` clamped to ``[0, 999]``.

    Rule: the epsilon objective draws ``t`` in ``[0, 1000)`` and reports ``sigma = t / 1000``
    (engine/train/objectives.py); discrete-timestep models (PixArt, the DDPM step of Stable Cascade's
    conversion) take ``t`` back as an integer. The product is computed in ``sigmas``' dtype.

    Args:
        sigmas: noise levels ``(B,)`` in ``[0, 1)``.

    Returns:
        ``(B,)`` int64 steps in ``[0, NUM_TRAIN_TIMESTEPS - 1]``.
    """
    return (sigmas * NUM_TRAIN_TIMESTEPS).round().clamp(0, NUM_TRAIN_TIMESTEPS - 1).long()


def alphas_cumprod() -> torch.Tensor:
    """``abar_t`` of the DDPM scaled-linear beta schedule, ``(NUM_TRAIN_TIMESTEPS,)`` float64.

    Rule: ``beta_t = linspace(sqrt(0.0001), sqrt(0.02), 1000)_t ** 2`` and
    ``abar_t = prod_{s <= t} (1 - beta_s)`` (Ho et al. 2020, "Denoising Diffusion Probabilistic
    Models"; the ``beta_schedule="scaled_linear"`` of ``diffusers/schedulers/scheduling_ddpm.py``,
    here in float64). The epsilon objective (engine/train/objectives.py) noises with it.
    """
    betas = torch.linspace(0.0001 ** 0.5, 0.02 ** 0.5, NUM_TRAIN_TIMESTEPS, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)
