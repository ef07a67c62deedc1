"""GRPO as in ReSearch (Chen et al., 2025, §2.1 eq. 1 and Appendix B).

G rollouts per question; the outcome reward of each is normalised within its group,
A_i = (r_i - mean_G r) / std_G r, broadcast over the rollout's action tokens (retrieved tokens are masked,
§2.1 "Retrieval Result Masking"); the clipped ratio objective plus β·KL(π || π_ref) with the k3 estimator
in the loss. Defaults are ReSearch's Table 4 (clip 0.2, KL 0.001, 5 rollouts: ``group_size``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from searchrl.algorithms import ADVANTAGES
from searchrl.algorithms.advantage_estimators import AdvantageInput, per_episode
from searchrl.algorithms.base import Algorithm, Probe, Requirements
from searchrl.algorithms.dapo import DynamicSampling, dynamic_collect, mask_truncated
from searchrl.algorithms.gigpo import GiGPOSettings
from searchrl.algorithms.igpo import IGPOSettings, answer_probes
from searchrl.algorithms.objective import PolicyObjective, declared
from searchrl.algorithms.policy_losses import batch_policy_loss
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import AT_LEAST_1, POSITIVE, setting
from searchrl.core.types import RolloutBatch, Trajectory
from searchrl.envs.context import unfold

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class GroupPolicyConfig(PolicyObjective):
    """The clipped-ratio objective (`algorithms.objective`) with group-normalised advantages (GRPO, SLATE,
    Tree-GRPO, ARPO)."""

    std_normalize: bool = setting(
        True, "divide by the group's reward std (eq. 1); false: Dr. GRPO, mean-centred"
    )
    eps: float = setting(1e-6, "added to the std before dividing", POSITIVE)
    advantage: str = setting(
        "grpo",
        "the advantage estimator (`algorithms.advantage_estimators`): grpo (eq. 1), rloo, reinforce (no "
        "baseline), reinforce_batch (batch-mean baseline), reinforce_baseline (group mean), reinforce_pp "
        "(REINFORCE++), reinforce_pp_baseline, gigpo and igpo (per-step credit, GRPO only), or a dotted path",
        registry="advantages",
    )


@dataclass(frozen=True)
class GRPOConfig(GroupPolicyConfig):
    group_size: int = setting(
        5, "G, rollouts per question (ReSearch Table 4); TRL's num_generations", AT_LEAST_1
    )
    dynamic_sampling: DynamicSampling = setting(
        DynamicSampling,
        "DAPO (`algorithms.dapo`): resample questions whose groups' rewards are all equal; and overlong filtering",
    )
    mask_truncated: bool = setting(
        False, "episodes that ran out of room (finish reason 'length') carry no loss"
    )
    gigpo: GiGPOSettings = setting(GiGPOSettings, "advantage gigpo's settings (`algorithms.gigpo`)")
    igpo: IGPOSettings = setting(IGPOSettings, "advantage igpo's settings (`algorithms.igpo`)")

    def __post_init__(self) -> None:
        super().__post_init__()
        # a group baseline (mean, std, leave-one-out) of a group of one is the reward itself: advantage 0
        if self.group_size < 2 and needs_group(self.advantage):
            alone = ", ".join(n for n in ADVANTAGES.names() if not needs_group(n))
            raise ValueError(
                f"group_size must be at least 2 for the '{self.advantage}' advantage's group baseline (a group "
                f"of one has advantage 0, so nothing trains; ReSearch uses 5), got {self.group_size}; "
                f"advantages {alone} need no group"
            )


def needs_group(advantage: str) -> bool:
    """Whether estimator ``advantage`` declares a group baseline (an unknown name: the registry refuses it)."""
    decl = declared(advantage)
    return decl is not None and decl.group


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
