"""Policy losses, chosen by ``algorithm.policy_loss`` on GRPO, SLATE, PPO and StePPO.

Each registered loss (`searchrl.algorithms.POLICY_LOSSES`) is
``f(logp, old_logp, advantages, mask, cfg) -> (loss (B, T), per-token metrics)``, unreduced (the trainer
aggregates with ``loss_agg``), with ρ_t = π_θ / π_old from ``cfg.clip_low`` / ``cfg.clip_high`` (ε_low, ε_high).
The sampler-trainer correction weight and the KL term are applied outside, the same way for every loss.

The sequence-level losses (gspo, gmpo) are one number per sequence, written on each of its action tokens:
with ``loss_agg: seq-mean-token-mean`` (which they require, as do gspo_token and sapo, whose papers and
anchors average per sequence) the objective is their papers' mean over sequences. Their papers' clip ranges
differ from PPO's: GSPO uses ε = 3e-4 / 4e-4 (§5.1), GMPO ε = 0.4 in log space (ρ ∈ [e^−0.4, e^0.4]);
MiniMax-M1's CISPO bounds only the upper side of the weight. ``dual_clip`` bounds the clipped ratio's loss
only (``clip``), as verl's ``clip_ratio_c``; it is refused with the others.

The log-ratios are the anchors': the token-level losses (clip, cispo, sapo) hold log ρ_t to ±20 before the
exp, as verl does (below e^20 nothing changes); GSPO and GMPO take the raw token log-ratios, as verl's
``compute_policy_loss_gspo`` / ``geo_mean`` and TRL's sequence-level ratio do, and GSPO caps only the
exponent of its sequence ratio at 10 (verl's). tests/algorithms/test_policy_losses_anchors.py checks each
against code written from verl and TRL.

Each loss is declared where it is defined (`algorithms.objective.policy_loss`): its name, what it requires and its
own arguments (``algorithm.policy_loss_args``). torch is imported inside the functions, so that this module and
its declarations load without it (`searchrl validate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from searchrl.algorithms.objective import LossSetting, arguments, declaration_of, policy_loss
from searchrl.core.config import POSITIVE

if TYPE_CHECKING:
    import torch

    from searchrl.core.types import RolloutBatch

Metrics = dict[str, "torch.Tensor"]
SEQ_MEAN = "seq-mean-token-mean"  # the aggregation of the losses whose papers average per sequence
SEQ_RATIO_CAP = 10.0  # the cap on GSPO's log sequence ratio (verl's), so exp cannot overflow


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1): the mean over each sequence's action tokens."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]


@policy_loss("clip", dual_clip=True)
def clip(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """PPO / GRPO's clipped surrogate (ReSearch eq. 1), with DAPO's clip-higher and the optional dual clip."""
    from searchrl.algorithms.loss_terms import clipped_policy_loss

    return clipped_policy_loss(logp, old_logp, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)


@policy_loss("entropy_balanced", dual_clip=True)
def entropy_balanced(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """AEPO's entropy clipping-balanced surrogate (Dong et al. 2025, arXiv 2510.14545, §4.2; the released
    ``compute_policy_loss_entropy_balanced_clipping``): the clipped surrogate whose upper bound is
    (1 + ε_high)·ρ_t / sg(ρ_t), so a token clipped there (a positive advantage, ρ_t > 1 + ε_high: the paper finds
    these are mostly high-entropy tokens) keeps the gradient (1 + ε_high)·A_t·∇log π_θ, rescaled, instead of
    none; the value and everything else are the clip's. The released code applies it to every token clipped at
    the top, not only high-entropy ones, and so does this."""
    from searchrl.algorithms.loss_terms import clipped_policy_loss

    return clipped_policy_loss(
        logp, old_logp, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip, keep_high_gradient=True
    )


def _clipped(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: Any, lr: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    from searchrl.algorithms.loss_terms import clipped_surrogate

    loss, clip_frac = clipped_surrogate(ratio, adv, cfg.clip_low, cfg.clip_high)
    metrics = {
        "clip_frac": clip_frac,
        "approx_kl": 0.5 * lr.detach() ** 2,
        "ratio": ratio.detach().expand_as(loss),
    }
    return loss, metrics


@policy_loss("gspo", loss_agg=SEQ_MEAN, sequence_level=True)
def gspo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, eq. 5-7): the sequence ratio s_i = exp(1/|y_i| Σ_t log ρ_{i,t}), clipped per
    sequence, ℓ_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i). The gradient flows through the
    length-normalised sum: each token gets s_i / |y_i| · ∇log π_θ(y_t)."""
    import torch

    lr = logp - old_logp  # raw, as verl's and TRL's: a per-token clamp would change the sequence mean
    s = torch.exp(_seq_mean(lr, mask).clamp(max=SEQ_RATIO_CAP))  # (B, 1), capped as verl's GSPO
    return _clipped(s, adv, cfg, lr)


@policy_loss("gspo_token", loss_agg=SEQ_MEAN)
def gspo_token(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], equal to s_i
    in value, with the token's own gradient, so a token-level advantage A_{i,t} may differ along a sequence.
    With one advantage per sequence its gradient is GSPO's."""
    import torch

    lr = logp - old_logp
    log_s = (logp - logp.detach() + _seq_mean(lr, mask).detach()).clamp(max=SEQ_RATIO_CAP)
    return _clipped(torch.exp(log_s), adv, cfg, lr)


@policy_loss("cispo")
def cispo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t ·
    log π_θ(y_t). The weight is clipped, not the token: every token keeps a gradient (a clipped PPO token
    gets none). TRL's ``loss_type: cispo`` bounds only the top (its ε_high is the bound itself)."""
    import torch

    from searchrl.algorithms.loss_terms import log_ratio

    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high).detach()
    loss = -weight * adv * logp
    with torch.no_grad():
        out = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
        metrics = {"clip_frac": out.float(), "approx_kl": 0.5 * lr.detach() ** 2, "ratio": ratio.detach()}
    return loss, metrics


@policy_loss("gmpo", loss_agg=SEQ_MEAN, sequence_level=True, geometric_weight=True)
def gmpo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, eq. 6): the geometric mean of the token ratios, each clipped in log space to
    [−ε_low, ε_high] on the side the advantage's sign makes pessimistic,

        ℓ_i = −A_i · exp(1/|y_i| Σ_t sgn(A_i) · min(sgn(A_i) log ρ_t, sgn(A_i) clip(log ρ_t, −ε_low, ε_high))),

    with A_i the sequence's advantage (the mean of its tokens', as verl's ``geo_mean``). The token log-ratios are
    not clamped before the bound (verl leaves that clamp commented out). Under a sampler-trainer correction the
    sequence's weight is the geometric mean of its tokens' (`batch_policy_loss`), as verl's."""
    import torch

    lr = logp - old_logp
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


@policy_loss(
    "sapo",
    loss_agg=SEQ_MEAN,
    settings={
        "tau_pos": LossSetting(
            1.0, "the gate's temperature for positive advantages (TRL's default)", POSITIVE
        ),
        "tau_neg": LossSetting(1.05, "… and for the others (TRL's default)", POSITIVE),
    },
)
def sapo(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"; TRL's ``loss_type: sapo``, verl's
    ``sapo``): the hard clip replaced by a smooth gate of the token ratio,

        ℓ_t = −f_τ(ρ_t) · A_t,   f_τ(ρ) = σ(τ (ρ − 1)) · 4 / τ,   τ = τ_pos if A_t > 0 else τ_neg,

    whose gradient 4σ'(τ(ρ−1)) ρ ∇log π_θ equals the plain policy gradient at ρ = 1 and fades smoothly as ρ
    leaves it (faster for negative advantages: τ_neg > τ_pos). ``policy_loss_args: {tau_pos, tau_neg}``
    default to TRL's 1.0 / 1.05. The log-ratio is held to ±20 as verl does (beyond it σ is saturated either
    way)."""
    import torch

    from searchrl.algorithms.loss_terms import log_ratio

    lr = log_ratio(logp, old_logp)
    ratio = torch.exp(lr)
    args = arguments(cfg, "sapo")
    tau_pos, tau_neg = args["tau_pos"], args["tau_neg"]
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = -gate * adv
    with torch.no_grad():
        metrics = {
            "clip_frac": torch.zeros_like(loss),  # nothing is clipped: the gate is smooth
            "approx_kl": 0.5 * lr.detach() ** 2,
            "ratio": ratio.detach(),
        }
    return loss, metrics


def batch_policy_loss(
    cfg: Any, logp: torch.Tensor, mb: RolloutBatch, advantages: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The config's policy loss (``policy_loss``, `algorithms.policy_losses`; the clipped ratio by default)
    of a micro-batch: π_old and advantages from its extras, times the sampler-trainer correction weight w_t
    of the decoupled objective (`algorithms.correction`) when there is one (GRPO, SLATE, PPO, StePPO).
    ``advantages``: these instead of the extras' (AEPO's entropy-aware ones, `algorithms.aepo`)."""
    import torch

    from searchrl.algorithms import POLICY_LOSSES

    name = getattr(cfg, "policy_loss", "clip")
    fn = POLICY_LOSSES.get(name)
    adv = mb.extras.need("advantages") if advantages is None else advantages
    loss, metrics = fn(logp, mb.extras.need("old_logp"), adv, mb.loss_mask, cfg)
    weight = mb.extras.is_weight
    if weight is not None:
        weight = weight.detach()
        # a loss declared with geometric weights (GMPO): one loss per sequence, weighted by the geometric mean
        # of its tokens' weights (verl's geo_mean)
        if declaration_of(name).geometric_weight:
            weight = torch.exp(_seq_mean(torch.log(weight + 1e-10), mb.loss_mask))
        loss = loss * weight
    return loss, metrics
