"""Per-token losses: registered pure functions returning (loss (B, T), per-token metrics {name: (B, T)}).

The trainer aggregates them with `functional.token_weights`, so every loss here is unreduced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from searchrl.registry import Registry

LOSSES: Registry[Callable[..., Any]] = Registry("loss")


@LOSSES.register("clipped_pg")
def clipped_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """PPO/GRPO clipped surrogate, negated for minimisation (ReSearch eq. 1, Schulman et al. 2017):

    ℓ_t = -min(ρ_t A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_t),  ρ_t = exp(logp_t - old_logp_t).
    Separate ε_low / ε_high allow DAPO's clip-higher.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_frac = (clipped < unclipped).float()  # the clip was active
        approx_kl = 0.5 * log_ratio**2
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl, "ratio": ratio.detach()}


@LOSSES.register("nll")
def nll_loss(logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the target tokens (SFT)."""
    return -logp, {"nll": -logp.detach()}
