"""DPO on step-level preference pairs, as RAG-Gym trains its agents (§2.2.2, eq. 6; Rafailov et al.):

    L = −log σ( β [ (log π(a⁺|s) − log π_ref(a⁺|s)) − (log π(a⁻|s) − log π_ref(a⁻|s)) ] )

with log π(a|s) summed over the action's tokens only (the state is context). The reference is the
policy with its adapter disabled under LoRA, a frozen copy otherwise; its log-probabilities are computed
once per step, before the update. Data: ``process_data.out`` (`searchrl collect-process-data`).

``rpo_alpha`` > 0 adds α times the chosen action's per-token NLL to each pair's loss (RPO, Pang et al.
2024; TRL's ``rpo_alpha``, which averages over the batch's chosen tokens rather than per action): plain
DPO can lower the likelihood of the chosen actions too, and on our small models it does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from searchrl.algorithms.base import Requirements
from searchrl.algorithms.preference import PairwiseAlgorithm, pair_split, place_pair_loss
from searchrl.core.config import AT_LEAST_0, POSITIVE, AlgorithmSettings, Range, check_ranges, setting
from searchrl.core.types import RolloutBatch

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


HALF_OPEN_HALF: Range = (lambda v: 0 <= v < 0.5, "in [0, 0.5) (at 0.5 the loss ignores the preference)")


@dataclass(frozen=True)
class DPOConfig(AlgorithmSettings):
    beta: float = setting(0.1, "β of the implicit reward β·log(π/π_ref) (RAG-Gym, Rafailov et al.)", POSITIVE)
    label_smoothing: float = setting(
        0.0, "conservative DPO's label noise (0: the plain sigmoid loss)", HALF_OPEN_HALF
    )
    rpo_alpha: float = setting(
        0.0, "weight of the chosen action's per-token NLL (0: plain DPO; RPO)", AT_LEAST_0
    )
    loss_agg: Literal["seq-mean-token-sum"] = setting("seq-mean-token-sum", "the pair loss is placed per row")

    def __post_init__(self) -> None:
        check_ranges(self)


def dpo_loss(
    pol_c: torch.Tensor,
    pol_r: torch.Tensor,
    ref_c: torch.Tensor,
    ref_r: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    rpo_alpha: float = 0.0,
    chosen_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss and the margin β·Δ, from sequence log-probabilities; with ``rpo_alpha``,
    plus α · ``chosen_nll`` (the chosen action's per-token NLL)."""
    logits = (pol_c - ref_c) - (pol_r - ref_r)
    loss = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
    if rpo_alpha:
        if chosen_nll is None:
            raise ValueError("rpo_alpha needs the chosen actions' per-token NLL")
        loss = loss + rpo_alpha * chosen_nll
    return loss, beta * logits


class DPO(PairwiseAlgorithm):
    Config = DPOConfig

    @classmethod
    def requires(cls, config: DPOConfig, env: EnvConfig) -> Requirements:
        return replace(super().requires(config, env), reference=True)  # π_ref of the implicit reward

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c, r = pair_split(mb)
        seq = (logp * mb.loss_mask).sum(-1)
        ref = (mb.extras.need("ref_logp") * mb.loss_mask).sum(-1)
        nll = -seq[c] / mb.loss_mask[c].sum(-1).clamp(min=1)
        loss, margin = dpo_loss(
            seq[c], seq[r], ref[c], ref[r], self.cfg.beta, self.cfg.label_smoothing, self.cfg.rpo_alpha, nll
        )
        placed = place_pair_loss(loss, c, r, mb.loss_mask)
        metrics = {
            "dpo_margin": place_pair_loss(margin.detach(), c, r, mb.loss_mask),
            "dpo_accuracy": place_pair_loss((margin > 0).float(), c, r, mb.loss_mask),
            "dpo_chosen_nll": place_pair_loss(nll.detach(), c, r, mb.loss_mask),
        }
        return placed, metrics
