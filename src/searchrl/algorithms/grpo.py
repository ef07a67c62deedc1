"""GRPO as in ReSearch (Chen et al., 2025, §2.1 eq. 1 and Appendix B).

G rollouts per question; the outcome reward of each is normalised within its group,
A_i = (r_i - mean_G r) / std_G r, broadcast over the rollout's action tokens (retrieved tokens are masked,
§2.1 "Retrieval Result Masking"); the clipped ratio objective plus β·KL(π || π_ref) with the k3 estimator
in the loss. Defaults are ReSearch's Table 4 (clip 0.2, KL 0.001, 5 rollouts: ``group_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from searchrl.aggregate import Mean
from searchrl.algorithms.advantages import broadcast_to_tokens, grpo_outcome
from searchrl.algorithms.base import Algorithm, Requirements, check_group_size
from searchrl.algorithms.correction import RolloutCorrection
from searchrl.algorithms.losses import batch_policy_loss, check_clip, check_stabilisers
from searchrl.functional import masked_sum
from searchrl.types import RolloutBatch

if TYPE_CHECKING:
    from searchrl.config import EnvConfig


@dataclass(frozen=True)
class GroupPolicyConfig:
    """The clipped-ratio objective with group-normalised advantages (GRPO and SLATE share it)."""

    clip_low: float = 0.2  # ε of eq. 1 (ReSearch Table 4); clip_high > clip_low gives DAPO's clip-higher
    clip_high: float = 0.2
    dual_clip: float | None = (
        None  # c > 1: negative-advantage losses capped at −c·A (verl's clip_ratio_c = 3)
    )
    kl_coef: float = 0.001  # β (ReSearch Table 4); 0 skips the reference model entirely
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float | None = (
        None  # bound each token's KL estimate to ±kl_clamp (verl: 10); None: eq. 1 as written
    )
    kl_in: Literal["loss", "reward"] = "loss"  # "reward": r_i -= β Σ_t KL_t before group normalisation
    std_normalize: bool = True  # False: Dr. GRPO (mean-centred only)
    eps: float = 1e-6
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"] = (
        "token-mean"
    )
    # sampler-trainer importance weights or masks (`algorithms.correction`); mode none: the papers' eq. 1
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)

    def __post_init__(self) -> None:
        check_clip(self.clip_low, self.clip_high)
        check_stabilisers(self.dual_clip, self.kl_clamp)


@dataclass(frozen=True)
class GRPOConfig(GroupPolicyConfig):
    group_size: int = 5  # G, rollouts per question (ReSearch Table 4); TRL's num_generations

    def __post_init__(self) -> None:
        super().__post_init__()
        check_group_size(self.group_size)
        if self.group_size < 2:  # A_i = (r_i − mean) / std over the group: a group of one is always 0
            raise ValueError(
                f"group_size must be at least 2 for GRPO's group-normalised advantage (a group of one has "
                f"advantage 0, so nothing trains; ReSearch uses 5), got {self.group_size}"
            )


class GRPO(Algorithm):
    Config: ClassVar[type] = GRPOConfig

    @classmethod
    def requires(cls, config: GRPOConfig, env: EnvConfig) -> Requirements:
        return Requirements(
            samples_per_item=config.group_size,
            reference=config.kl_coef > 0,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
        )

    @property
    def kl_coef(self) -> float:
        return float(self.cfg.kl_coef)

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        rewards = batch.rewards
        metrics: dict[str, float] = {}
        if self.cfg.kl_in == "reward" and self.kl_coef > 0:
            kl = self.kl_estimate(batch.extras["old_logp"], batch.extras["ref_logp"])
            seq_kl = masked_sum(kl, batch.loss_mask, dim=-1)  # (B,)
            rewards = rewards - self.kl_coef * seq_kl
            metrics["kl/sequence"] = Mean(float(seq_kl.sum()), len(seq_kl))
        adv = grpo_outcome(rewards, batch.group_ids, self.cfg.std_normalize, self.cfg.eps)
        batch.extras["advantages"] = broadcast_to_tokens(adv, batch.loss_mask)
        return metrics

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = batch_policy_loss(self.cfg, logp, mb)
        return self.with_kl(loss, metrics, logp, entropy, mb)
