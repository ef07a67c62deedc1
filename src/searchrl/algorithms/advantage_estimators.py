"""Advantage estimators for the group-sampling algorithms (GRPO, SLATE), chosen by ``algorithm.advantage``.

Each registered estimator (`searchrl.algorithms.ADVANTAGES`) is ``f(x: AdvantageInput) -> (B, T)`` token
advantages, 0 off the loss mask; the equation it implements is in its docstring. The sequence-level ones
(grpo, rloo, reinforce, reinforce_batch, reinforce_baseline, reinforce_pp_baseline) see the outcome reward less β·Σ_t KL_t when the KL
is in the reward (``kl_in: reward``); REINFORCE++ places −β·KL_t on each token instead.

Batch-level statistics (REINFORCE++'s whitening) are global: summed over processes with ``sum_all``, so N
processes compute what one process holding their union would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from searchrl.algorithms.advantage_math import broadcast_to_tokens, gae, grpo_outcome, token_rewards
from searchrl.algorithms.objective import advantage_estimator

if TYPE_CHECKING:
    from searchrl.core.types import RolloutBatch


@dataclass
class AdvantageInput:
    rewards: torch.Tensor  # (B,) outcome rewards
    group_ids: torch.Tensor  # (B,)
    loss_mask: torch.Tensor  # (B, T) action tokens
    kl: torch.Tensor | None  # (B, T) β·KL_t per action token when the KL is in the reward, else None
    cfg: Any  # the algorithm's config (std_normalize, eps)
    sum_all: Callable[[Any], float] = float  # sums a number over processes
    # the whole batch, for the estimators that read its steps (gigpo's anchor states, igpo's probes); None in
    # the sequence-level calls over folded episodes (`per_episode`)
    batch: RolloutBatch | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what the estimator reports (its step groups, …)

    def steps(self, name: str) -> RolloutBatch:
        """The batch, for an estimator that reads its steps (``name``: the estimator, for the message)."""
        if self.batch is None:
            raise ValueError(
                f"the {name} advantage reads the batch's steps: GRPO passes them (AdvantageInput.batch)"
            )
        return self.batch

    def penalised(self) -> torch.Tensor:
        """(B,) r_i − β Σ_t KL_t (the sequence-level KL penalty), or r_i."""
        if self.kl is None:
            return self.rewards
        return self.rewards - (self.kl * self.loss_mask).sum(-1)


def rloo_outcome(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, eq. 3): A_i = r_i − 1/(G−1) Σ_{j≠i} r_j
    = G/(G−1) · (r_i − mean_G r). (B,) -> (B,); a group of one gets 0."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].double()
        n = r.numel()
        if n < 2:
            continue
        adv[idx] = (r - (r.sum() - r) / (n - 1)).float()
    return adv


def group_mean_baseline(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the group mean as baseline: A_i = r_i − mean_G r (the group includes i). (B,) -> (B,)."""
    return grpo_outcome(rewards, group_ids, std_normalize=False)


def global_whiten(
    x: torch.Tensor, mask: torch.Tensor, sum_all: Callable[[Any], float] = float, eps: float = 1e-8
) -> torch.Tensor:
    """(x − μ) / √(σ² + eps) over the masked entries of the whole batch, every process included; σ² is the
    unbiased variance (as verl's ``masked_whiten``). 0 off the mask."""
    m = mask.double()
    n = sum_all(float(m.sum()))
    if n < 2:
        return torch.zeros_like(x)
    mean = sum_all(float((x.double() * m).sum())) / n
    var = sum_all(float((((x.double() - mean) ** 2) * m).sum())) / (n - 1)
    return ((x.double() - mean) / (var + eps) ** 0.5 * m).to(x.dtype)


def reward_to_go(token_reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{t' ≥ t} r_{t'} over the action tokens (γ = 1; observation tokens are skipped). (B, T)."""
    return gae(token_reward, torch.zeros_like(token_reward), mask, gamma=1.0, lam=1.0)[0]


def per_episode(
    estimator: Callable[[AdvantageInput], torch.Tensor], x: AdvantageInput, episode_ids: torch.Tensor
) -> torch.Tensor:
    """A sequence-level estimator over *episodes* when an episode spans several rows (its folded contexts,
    `envs.context`): group baselines, batch means and counts see each episode once (with the KL penalty of all
    its rows when the KL is in the reward), and every row of an episode gets its advantage. Rows with
    ``episode_ids`` −1 are episodes of their own; rows that belong to no episode (the trainer's padding rows:
    negative group ids) get 0 and are not counted. (B, T), 0 off the loss mask."""
    ep = episode_ids.long()
    real = x.group_ids >= 0
    key = torch.where(
        ep >= 0, ep, -1 - torch.arange(len(ep), device=ep.device)
    )  # lone rows: keys of their own
    keys = torch.unique(key[real])
    if not len(keys):
        return torch.zeros_like(x.loss_mask)
    row_to_ep = torch.searchsorted(keys, key.clamp(max=int(keys.max())))  # (B,); meaningless on unreal rows
    first = torch.full((len(keys),), len(ep), dtype=torch.long, device=ep.device)
    rows = torch.arange(len(ep), device=ep.device)
    first = first.scatter_reduce(0, row_to_ep[real], rows[real], reduce="amin")
    trained = torch.zeros(len(keys), device=ep.device).index_add(
        0, row_to_ep[real], x.loss_mask[real].sum(-1)
    )
    kl = None
    if x.kl is not None:
        per_row = (x.kl * x.loss_mask).sum(-1)
        kl = torch.zeros(len(keys), device=ep.device).index_add(0, row_to_ep[real], per_row[real])[:, None]
    mask = (trained > 0).float()[:, None]
    sub = AdvantageInput(x.rewards[first], x.group_ids[first], mask, kl, x.cfg, x.sum_all)
    adv = estimator(sub)[:, 0]  # (E,): each episode's advantage (0 where it has no loss tokens)
    out = adv[row_to_ep] * real.float()
    return broadcast_to_tokens(out, x.loss_mask)


# ------------------------------------------------------------------------------ the registered estimators


@advantage_estimator("grpo", level="sequence")
def grpo(x: AdvantageInput) -> torch.Tensor:
    """GRPO (ReSearch eq. 1): (r_i − mean_G r) / (std_G r + ε); Dr. GRPO with ``std_normalize: false``."""
    adv = grpo_outcome(x.penalised(), x.group_ids, x.cfg.std_normalize, x.cfg.eps)
    return broadcast_to_tokens(adv, x.loss_mask)


@advantage_estimator("rloo", level="sequence")
def rloo(x: AdvantageInput) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, eq. 3): the leave-one-out baseline, no scaling."""
    return broadcast_to_tokens(rloo_outcome(x.penalised(), x.group_ids), x.loss_mask)


@advantage_estimator("reinforce_baseline", level="sequence")
def reinforce_baseline(x: AdvantageInput) -> torch.Tensor:
    """REINFORCE (Williams 1992) with the group-mean baseline: r_i − mean_G r, no scaling."""
    return broadcast_to_tokens(group_mean_baseline(x.penalised(), x.group_ids), x.loss_mask)


@advantage_estimator("reinforce", level="sequence", group=False)
def reinforce(x: AdvantageInput) -> torch.Tensor:
    """REINFORCE (Williams 1992, eq. 11) without a baseline: every action token of episode i gets A = r_i.
    With one optimizer update per rollout batch (``trainer.epochs: 1``, ``mini_batches: 1``) the ratio is 1 at
    the update, so the clipped objective's gradient is exactly REINFORCE's; Search-R1++ (arXiv 2602.19526)
    found REINFORCE ahead of PPO and GRPO for search agents."""
    return broadcast_to_tokens(x.penalised(), x.loss_mask)


@advantage_estimator("reinforce_batch", level="sequence", group=False)
def reinforce_batch(x: AdvantageInput) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: A_i = r_i − mean_batch r, the mean over every process's
    episodes, the trainer's padding rows left out (as verl's batch mean over real rows; no group structure,
    no scaling). The baseline variant of `reinforce`; which of the two
    Search-R1++ uses is not stated in the sources at hand, so both are offered."""
    r = x.penalised().double()
    real = x.group_ids >= 0  # the trainer's padding rows (negative group ids) are no episodes: not counted
    n = x.sum_all(float(real.sum()))
    mean = x.sum_all(float(r[real].sum())) / n if n else 0.0
    return broadcast_to_tokens(((r - mean) * real).float(), x.loss_mask)


@advantage_estimator("reinforce_pp", level="token", group=False)
def reinforce_pp(x: AdvantageInput) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, §3): token rewards r_t = 1[t = last]·r − β·KL_t, their reward-to-go
    G_t = Σ_{t'≥t} r_{t'} (γ = 1), whitened over every action token of the global batch (eq. 10)."""
    zeros = torch.zeros((len(x.rewards), 1), device=x.loss_mask.device)
    tok = token_rewards(x.rewards, zeros, zeros.long(), zeros.bool(), x.loss_mask)
    if x.kl is not None:
        tok = tok - x.kl * x.loss_mask
    return global_whiten(reward_to_go(tok, x.loss_mask), x.loss_mask, x.sum_all)


@advantage_estimator("reinforce_pp_baseline", level="token")
def reinforce_pp_baseline(x: AdvantageInput) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, §3.2): r_i − mean_G r, broadcast to the action tokens and
    whitened over the global batch's action tokens (verl's ``reinforce_plus_plus_baseline``)."""
    centred = broadcast_to_tokens(group_mean_baseline(x.penalised(), x.group_ids), x.loss_mask)
    return global_whiten(centred, x.loss_mask, x.sum_all)
