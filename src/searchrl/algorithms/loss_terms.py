"""Per-token losses: pure functions returning (loss (B, T), per-token metrics {name: (B, T)}).

The trainer aggregates them with `functional.token_weights`, so every loss here is unreduced.
"""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    keep_high_gradient: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate, negated for minimisation (ReSearch eq. 1, Schulman et al. 2017):

    ℓ_t = -min(ρ_t A_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) A_t),  ρ_t = exp(logp_t - old_logp_t).
    Separate ε_low / ε_high allow DAPO's clip-higher. The log-ratio is held to ±20 before the exp, as verl
    does, so a stale token cannot overflow (it changes nothing below ρ = 4.8e8). ``dual_clip`` = c > 1 bounds
    the loss of negative-advantage tokens by −c·A_t (Ye et al. 2020, verl's ``clip_ratio_c``, default 3
    there); None, our default, is the papers' eq. 1. ``keep_high_gradient``: AEPO's entropy-balanced clipping
    (`clipped_surrogate`).
    """
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    loss, clip_frac = clipped_surrogate(ratio, advantages, clip_low, clip_high, keep_high_gradient)
    metrics: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        if dual_clip <= 1.0:  # the config refuses it (`algorithms.objective`); a direct call too
            raise ValueError(f"dual_clip must be > 1 (verl uses 3) or None, got {dual_clip}")
        bound = -dual_clip * advantages
        capped = (advantages < 0) & (loss > bound)
        loss = torch.where(capped, bound, loss)
        metrics["dual_clip_frac"] = capped.float().detach()
    return loss, {
        "clip_frac": clip_frac,
        "approx_kl": 0.5 * lr.detach() ** 2,
        "ratio": ratio.detach(),
        **metrics,
    }


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log ρ = log π_θ − log π_old, held to ±20 as verl does: a stale token cannot overflow the exp."""
    return (logp - old_logp).clamp(-20.0, 20.0)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    keep_high_gradient: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """−min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A) (token ρ for PPO/GRPO, sequence ρ for GSPO), and where
    the clip was active (a constant, broadcast to the loss's shape).

    ``keep_high_gradient``: AEPO's entropy clipping-balanced mechanism (arXiv 2510.14545; the released
    ``compute_policy_loss_entropy_balanced_clipping``): the upper bound is (1 + ε_high)·ρ / sg(ρ), equal to
    1 + ε_high in value, so a token clipped there keeps the gradient (1 + ε_high)·A·∇log π instead of none.
    Only positive-advantage tokens are clipped at the top; the lower bound stays a constant."""
    unclipped = ratio * advantages
    if keep_high_gradient:
        high = (1.0 + clip_high) * ratio / ratio.detach()
        clipped = torch.minimum(ratio.clamp(min=1.0 - clip_low), high) * advantages
    else:
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float().detach().expand_as(loss)


def nll_loss(logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the target tokens (SFT)."""
    return -logp, {"nll": -logp.detach()}
