"""Policy losses, chosen by ``algorithm.policy_loss`` on GRPO, SLATE, PPO and StePPO.

Each registered loss (`searchrl.algorithms.POLICY_LOSSES`) is
``f(logp, old_logp, advantages, mask, cfg) -> (loss (B, T), per-token metrics)``, unreduced (the trainer
aggregates with ``loss_agg``), with ρ_t = π_θ / π_old from ``cfg.clip_low`` / ``cfg.clip_high`` (ε_low, ε_high).
The sampler-trainer correction weight and the KL term are applied outside, the same way for every loss.

The sequence-level losses (gspo, gmpo) are one number per sequence, written on each of its action tokens:
with ``loss_agg: seq-mean-token-mean`` (which they require) the objective is their papers' mean over
sequences. Their papers' clip ranges differ from PPO's: GSPO uses ε = 3e-4 / 4e-4 (§5.1), GMPO ε = 0.4 in
log space (ρ ∈ [e^−0.4, e^0.4]); MiniMax-M1's CISPO bounds only the upper side of the weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from searchrl.algorithms.losses import clipped_policy_loss, clipped_surrogate, log_ratio

if TYPE_CHECKING:
    from searchrl.core.types import RolloutBatch

Metrics = dict[str, torch.Tensor]

SEQUENCE_LEVEL = ("gspo", "gmpo")  # one loss per sequence: need loss_agg seq-mean-token-mean


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1): the mean over each sequence's action tokens."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]


def clip(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """PPO / GRPO's clipped surrogate (ReSearch eq. 1), with DAPO's clip-higher and the optional dual clip."""
    return clipped_policy_loss(logp, old_logp, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)


def _clipped(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: Any, lr: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    loss, clip_frac = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    metrics = {
        "clip_frac": clip_frac,
        "approx_kl": 0.5 * lr.detach() ** 2,
        "ratio": ratio.detach().expand_as(loss),
    }
    return loss, metrics


def gspo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, eq. 5-7): the sequence ratio s_i = exp(1/|y_i| Σ_t log ρ_{i,t}), clipped per
    sequence, ℓ_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i). The gradient flows through the
    length-normalised sum: each token gets s_i / |y_i| · ∇log π_θ(y_t)."""
    lr = log_ratio(logp, old_logp)
    s = torch.exp(_seq_mean(lr, mask).clamp(max=10.0))  # (B, 1), capped as verl's GSPO
    return _clipped(s, adv, cfg, lr)


def gspo_token(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], equal to s_i
    in value, with the token's own gradient, so a token-level advantage A_{i,t} may differ along a sequence.
    With one advantage per sequence its gradient is GSPO's."""
    lr = log_ratio(logp, old_logp)
    log_s = (logp - logp.detach() + _seq_mean(lr, mask).detach()).clamp(max=10.0)
    return _clipped(torch.exp(log_s), adv, cfg, lr)


def cispo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t ·
    log π_θ(y_t). The weight is clipped, not the token: every token keeps a gradient (a clipped PPO token
    gets none). TRL's ``loss_type: cispo`` bounds only the top (its ε_high is the bound itself)."""
    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high).detach()
    loss = -weight * adv * logp
    with torch.no_grad():
        out = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
        metrics = {"clip_frac": out.float(), "approx_kl": 0.5 * lr.detach() ** 2, "ratio": ratio.detach()}
    return loss, metrics


def gmpo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, eq. 6): the geometric mean of the token ratios, each clipped in log space to
    [−ε_low, ε_high] on the side the advantage's sign makes pessimistic,

        ℓ_i = −A_i · exp(1/|y_i| Σ_t sgn(A_i) · min(sgn(A_i) log ρ_t, sgn(A_i) clip(log ρ_t, −ε_low, ε_high))),

    with A_i the sequence's advantage (the mean of its tokens', as verl's ``geo_mean``)."""
    lr = log_ratio(logp, old_logp)
    a = _seq_mean(adv, mask)  # (B, 1)
    sign = torch.sign(a)
    bounded = sign * torch.minimum(sign * lr, sign * lr.clamp(-cfg.clip_low, cfg.clip_high))
    ratio = torch.exp(_seq_mean(bounded, mask))  # (B, 1)
    loss = (-a * ratio).expand_as(logp)
    with torch.no_grad():
        clipped = ((bounded != lr) & (sign != 0)).float()
        metrics = {"clip_frac": clipped, "approx_kl": 0.5 * lr.detach() ** 2}
        metrics["ratio"] = ratio.detach().expand_as(loss)
    return loss, metrics


def batch_policy_loss(
    cfg: Any, logp: torch.Tensor, mb: RolloutBatch
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The config's policy loss (``policy_loss``, `algorithms.policy_losses`; the clipped ratio by default)
    of a micro-batch: π_old and advantages from its extras, times the sampler-trainer correction weight w_t
    of the decoupled objective (`algorithms.correction`) when there is one (GRPO, SLATE, PPO, StePPO)."""
    from searchrl.algorithms import POLICY_LOSSES

    fn = POLICY_LOSSES.get(getattr(cfg, "policy_loss", "clip"))
    loss, metrics = fn(logp, mb.extras["old_logp"], mb.extras["advantages"], mb.loss_mask, cfg)
    weight = mb.extras.get("is_weight")
    if weight is not None:
        loss = loss * weight.detach()
    return loss, metrics


def check_policy_loss(policy_loss: str, loss_agg: str) -> None:
    """A sequence-level loss (GSPO, GMPO) is one number per sequence: its paper's objective is the mean over
    sequences, so the aggregation must be ``seq-mean-token-mean``."""
    if policy_loss in SEQUENCE_LEVEL and loss_agg != "seq-mean-token-mean":
        raise ValueError(
            f"policy_loss '{policy_loss}' is a per-sequence objective (the mean over sequences); set "
            f"loss_agg: seq-mean-token-mean (got '{loss_agg}', which would weight each sequence by its length)"
        )
