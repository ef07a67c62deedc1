"""GRPO as in ReSearch (Chen et al., 2025, §2.1 eq. 1 and Appendix B).

G rollouts per question; the outcome reward of each is normalised within its group,
A_i = (r_i - mean_G r) / std_G r, broadcast over the rollout's action tokens (retrieved tokens are masked,
§2.1 "Retrieval Result Masking"); the clipped ratio objective plus β·KL(π || π_ref) with the k3 estimator
in the loss. Defaults are ReSearch's Table 4 (clip 0.2, KL 0.001, 5 rollouts: ``group_size``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from searchrl.algorithms.advantage_estimators import AdvantageInput, per_episode
from searchrl.algorithms.base import Algorithm, Probe, Requirements, check_group_size
from searchrl.algorithms.correction import RolloutCorrection
from searchrl.algorithms.dapo import DynamicSampling, dynamic_collect, mask_truncated
from searchrl.algorithms.gigpo import GiGPOSettings
from searchrl.algorithms.igpo import IGPOSettings, answer_probes
from searchrl.algorithms.loss_terms import check_clip, check_stabilisers
from searchrl.algorithms.policy_losses import batch_policy_loss, check_policy_loss
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.types import RolloutBatch, Trajectory
from searchrl.envs.context import unfold

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


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
    # the advantage estimator (`algorithms.advantage_estimators`): grpo (eq. 1), rloo, reinforce (no baseline),
    # reinforce_batch (batch-mean baseline), reinforce_baseline (group mean), reinforce_pp (REINFORCE++),
    # reinforce_pp_baseline, gigpo and igpo (per-step credit, GRPO only), or a dotted path to your own
    advantage: str = field(default="grpo", metadata={"registry": "advantages"})
    # the policy loss (`algorithms.policy_losses`): clip (eq. 1), gspo, gspo_token, cispo, gmpo, sapo, or a dotted path
    policy_loss: str = field(default="clip", metadata={"registry": "policy_losses"})
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages (TRL's default)
    sapo_tau_neg: float = 1.05  # … and for the others (TRL's default)

    def __post_init__(self) -> None:
        check_clip(self.clip_low, self.clip_high)
        check_stabilisers(self.dual_clip, self.kl_clamp)
        check_policy_loss(
            self.policy_loss, self.loss_agg, self.dual_clip, (self.sapo_tau_pos, self.sapo_tau_neg)
        )


# the estimators without a group baseline: they train with groups of one
NO_GROUP = ("reinforce", "reinforce_batch", "reinforce_pp")


@dataclass(frozen=True)
class GRPOConfig(GroupPolicyConfig):
    group_size: int = 5  # G, rollouts per question (ReSearch Table 4); TRL's num_generations
    # DAPO (`algorithms.dapo`): resample questions whose groups' rewards are all equal; and overlong filtering
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    mask_truncated: bool = False  # episodes that ran out of room (finish reason "length") carry no loss
    gigpo: GiGPOSettings = field(default_factory=GiGPOSettings)  # advantage gigpo's (`algorithms.gigpo`)
    igpo: IGPOSettings = field(default_factory=IGPOSettings)  # advantage igpo's (`algorithms.igpo`)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_group_size(self.group_size)
        # a group baseline (mean, std, leave-one-out) of a group of one is the reward itself: advantage 0
        if self.group_size < 2 and self.advantage not in NO_GROUP:
            raise ValueError(
                f"group_size must be at least 2 for the '{self.advantage}' advantage's group baseline (a group "
                f"of one has advantage 0, so nothing trains; ReSearch uses 5), got {self.group_size}; "
                f"advantages {', '.join(NO_GROUP)} need no group"
            )


class GRPO(Algorithm):
    Config: ClassVar[type] = GRPOConfig

    @classmethod
    def requires(cls, config: GRPOConfig, env: EnvConfig) -> Requirements:
        # training rows per episode: one per context when long episodes are folded (`envs.context`); an agent
        # program's episode at most one per completion it may ask for (`rollout.agent_program`)
        segments = env.context.max_segments if env.context is not None else 1
        if env.protocol == "agent" and env.agent_program is not None:
            segments = env.agent_program.max_calls
        return Requirements(
            samples_per_item=config.group_size * segments,
            reference=config.kl_coef > 0,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
            probes=config.advantage == "igpo",  # the answer's probability after each turn
        )

    @property
    def kl_coef(self) -> float:
        return float(self.cfg.kl_coef)

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """G episodes per question (`Algorithm.collect`); with DAPO's dynamic sampling, only groups whose
        rewards differ, resampling questions; with ``mask_truncated``, cut-off episodes out of the loss; with
        ``env.context``, each folded episode as one row per context (`envs.context.unfold`)."""
        ds = self.cfg.dynamic_sampling
        if ds.enabled:
            rng = random.Random(f"dapo:{self.step}:{indices}")  # a str seed is hashed stably (sha512)
            n = self.num_items()
            got = dynamic_collect(self.episodes, indices, n, ds, rng, f" (step {self.step + 1})")
            return self.finish(*got)
        return self.finish(*self.episodes(indices))

    def finish(
        self, trajs: list[Trajectory], metrics: dict[str, float]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """With ``mask_truncated``, cut-off episodes out of the loss; with ``env.context``, each folded episode
        as one row per context (`envs.context.unfold`), and an agent program's episode as one row per
        conversation it held (`rollout.agent_program`): for collected and asynchronous batches alike."""
        if self.cfg.mask_truncated:
            metrics["dapo/truncated_masked"] = Sum(mask_truncated(trajs))
        env = self.ctx.env
        if getattr(env, "context", None) is not None or getattr(env, "splits_episodes", False):
            trajs = unfold(trajs)
        return trajs, metrics

    def probes(self, trajs: list[Trajectory], batch: RolloutBatch) -> list[Probe]:
        """IGPO's answer probes: the gold answer teacher-forced before each step (`algorithms.igpo`)."""
        if self.cfg.advantage != "igpo":
            return []
        return answer_probes(trajs, batch, self.ctx.env, self.ctx.tokenizer)

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        from searchrl.algorithms import ADVANTAGES

        metrics: dict[str, float] = {}
        kl = None
        if self.cfg.kl_in == "reward" and self.kl_coef > 0:
            kl = (
                self.kl_estimate(batch.extras.need("old_logp"), batch.extras.need("ref_logp"))
                * batch.loss_mask
            )
            w = self.kl_weight(
                batch
            )  # the reward's penalty is carried by the policy loss's weight; the metric
            seq_kl = (kl if w is None else kl * w).sum(-1)  # (B,)
            metrics["kl/sequence"] = Mean(float(seq_kl.sum()), len(seq_kl))
            kl = self.kl_coef * kl
        sum_all = self.ctx.sum_all if self.ctx is not None else float  # one process: the batch is global
        x = AdvantageInput(batch.rewards, batch.group_ids, batch.loss_mask, kl, self.cfg, sum_all, batch)
        estimator = ADVANTAGES.get(self.cfg.advantage)
        episodes = batch.extras.episode_ids  # folded episodes: baselines over episodes, not rows
        adv = estimator(x) if episodes is None else per_episode(estimator, x, episodes)
        batch.extras.advantages = adv * batch.loss_mask
        return {**metrics, **x.metrics}

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = batch_policy_loss(self.cfg, logp, mb)
        return self.with_kl(loss, metrics, logp, entropy, mb)
