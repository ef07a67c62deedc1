"""Advantage estimators: registered pure functions on tensors. Shapes: B sequences, T tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from searchrl.registry import Registry

ADVANTAGES: Registry[Callable[..., Any]] = Registry("advantage estimator")


@ADVANTAGES.register("grpo")
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
