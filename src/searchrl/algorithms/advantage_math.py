"""Advantage estimators: pure functions on tensors. Shapes: B sequences, T tokens."""

from __future__ import annotations

import torch


def grpo_outcome(
    rewards: torch.Tensor, group_ids: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised outcome advantage (ReSearch eq. 1): A_i = (r_i - mean_g r) / (std_g r + eps).

    ``rewards`` (B,), ``group_ids`` (B,) -> (B,). std is the unbiased sample std of the group (as in
    verl/TRL); a group of one gets advantage 0. With ``std_normalize=False`` only the mean is removed
    (Dr. GRPO).
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].double()  # float32 group means of equal rewards leave ~1e-8 that eps would amplify
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        denom = r.std() + eps
        # identical rewards carry no signal: their centred values are 0 (and 0/0 must not become NaN)
        adv[idx] = (centred / denom if std_normalize and denom > 0 else centred).float()
    return adv


def broadcast_to_tokens(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantage -> (B, T) on action tokens, 0 elsewhere."""
    return adv[:, None] * loss_mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE (Schulman et al., 2015) over the action tokens only: (advantages, returns), (B, T).

    ``rewards``, ``values`` (B, T) are read only where ``mask`` (B, T) is 1. The action tokens of a
    sequence form one chain t_1 < … < t_n; retrieved (observation) and padding tokens between them are
    skipped, so they carry no TD error and the next value and the running advantage pass across them:

        δ_k = r_{t_k} + γ V_{t_{k+1}} − V_{t_k}   (V_{t_{n+1}} = 0),   A_k = δ_k + γλ A_{k+1},   R_k = A_k + V_{t_k}.

    Search-R1's public code runs GAE over retrieved tokens too; here a retrieved token cannot change
    anything. With γ = λ = 1 and V = 0, A is the reward-to-go. Returned tensors are 0 off the mask.
    """
    m = mask.bool()
    r, v = rewards.double(), values.double()
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * running
        on = m[:, t]
        running = torch.where(on, a, running)
        next_value = torch.where(on, v[:, t], next_value)
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
    returns = (adv + v) * m
    return adv.float(), returns.float()


def token_rewards(
    batch_rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    step_ends: torch.Tensor,
    step_mask: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """(B, T) rewards: the outcome reward (B,) at each sequence's last action token, and the step rewards
    (B, S) at their steps' last action tokens (StepSearch §2.3: "The global reward is set at the last
    position of the output, while the step-wise reward is set at the last token of each round")."""
    B, T = loss_mask.shape
    out = torch.zeros((B, T), dtype=torch.float32, device=loss_mask.device)
    pos = torch.arange(T, device=loss_mask.device).expand(B, T)
    rows = (loss_mask.sum(-1) > 0).nonzero().squeeze(-1)
    last = torch.where(loss_mask.bool(), pos, -1).max(-1).values
    out.index_put_((rows, last[rows]), batch_rewards.float()[rows], accumulate=True)
    b_idx = torch.arange(B, device=loss_mask.device)[:, None].expand_as(step_ends)
    out.index_put_((b_idx[step_mask], step_ends[step_mask]), step_rewards[step_mask].float(), accumulate=True)
    return out


def discounted_by_slot(r: dict[int, float], gamma: float) -> dict[int, float]:
    """Per-step rewards {step slot: r_k} -> their discounted returns {slot: Σ_{j≥k} γ^{j−k} r_j}, in slot order."""
    out, running = {}, 0.0
    for k in sorted(r, reverse=True):
        running = r[k] + gamma * running
        out[k] = running
    return out


def steps_to_tokens(
    values: list[dict[int, float]], step_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per-row {step slot: advantage} -> (B, T): each step's value on its action tokens, 0 elsewhere."""
    out = torch.zeros_like(loss_mask)
    for b, per_step in enumerate(values):
        for k, v in per_step.items():
            out[b] += v * (step_ids[b] == k).float()
    return out * loss_mask
