"""PPO with a GAE critic, as in Search-R1 (Jin et al., 2025) and StepSearch's eq. 1.

The critic is a value head on the policy (`models.policy.PolicyWithValue`): one module, one engine under
ZeRO-3; under LoRA the adapter and the head train. Per step:

1. rollouts, scored by the reward pipeline: an outcome reward per episode and, for process rewards
   (StePPO), one score per step;
2. token rewards: the outcome at the last action token, step scores at each step's last action token,
   and, with ``kl_in: reward``, −β·KL_t on every action token (β fixed, or adaptive à la Ziegler et al.);
3. GAE(γ, λ) over the action tokens only (`advantage_math.gae`: retrieved tokens carry no TD error), then
   advantages whitened over the batch's action tokens (unbiased std, as verl, which Search-R1 runs on);
4. loss per action token: the clipped surrogate (skipped during ``critic_warmup_steps``) plus
   ``vf_coef`` · ½·max((V − R)², (V_clip − R)²) with V_clip = V_old + clip(V − V_old, ±value_clip), plus
   β·KL with ``kl_in: loss``.

Defaults follow Search-R1's PPO recipe (γ = λ = 1, clip 0.2, KL 0.001, critic lr 10× the actor's as in
StepSearch Appendix B's 7e-7 / 7e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from searchrl.algorithms.advantage_math import gae, token_rewards
from searchrl.algorithms.base import Algorithm, Requirements, head_param_groups
from searchrl.algorithms.objective import PolicyObjective
from searchrl.algorithms.policy_losses import batch_policy_loss
from searchrl.core.config import AT_LEAST_0, AT_LEAST_1, POSITIVE, ZERO_TO_ONE, setting
from searchrl.core.types import RolloutBatch

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class PPOConfig(PolicyObjective):
    """The clipped-ratio objective (`algorithms.objective`) on GAE advantages from a value head, with
    Search-R1's KL in the reward (k1)."""

    gamma: float = setting(1.0, "γ, the discount of GAE (Search-R1: 1)", ZERO_TO_ONE)
    lam: float = setting(1.0, "λ of GAE (Search-R1: 1)", ZERO_TO_ONE)
    value_clip: float = setting(
        0.2, "the value's clip around its old value; 0 turns value clipping off", AT_LEAST_0
    )
    vf_coef: float = setting(0.5, "the value loss's weight", AT_LEAST_0)
    critic_lr: float | None = setting(None, "the value head's learning rate; null: 10 × trainer.lr", POSITIVE)
    critic_warmup_steps: int = setting(
        0, "steps that train only the critic (the policy loss is 0)", AT_LEAST_0
    )
    detach_value_trunk: bool = setting(False, "true: the value loss trains the head only, not the shared LM")
    whiten_advantages: bool = setting(True, "whiten the advantages over the batch's action tokens (verl's)")
    kl_estimator: Literal["k1", "k2", "k3"] = setting(
        "k1", "the per-token KL estimator (Search-R1's PPO: k1)"
    )
    kl_in: Literal["reward", "loss"] = setting(
        "reward", "where β·KL enters: the reward (−β·KL_t on each action token, Search-R1), or the loss"
    )
    adaptive_kl: bool = setting(False, "Ziegler et al. (2019): β follows the measured KL towards kl_target")
    kl_target: float = setting(0.01, "the KL the adaptive β aims at", POSITIVE)
    kl_horizon: int = setting(10000, "the adaptive β's horizon, in sequences", AT_LEAST_1)
    group_size: int = setting(
        1, "rollouts per question (Search-R1's PPO: one; the critic needs no group)", AT_LEAST_1
    )


class AdaptiveKL:
    """β ← β · (1 + clip(KL / target − 1, ±0.2) · n / horizon), with n the sequences in the batch."""

    def __init__(self, init: float, target: float, horizon: int) -> None:
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, n: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon


class PPO(Algorithm):
    Config = PPOConfig

    @classmethod
    def requires(cls, config: PPOConfig, env: EnvConfig) -> Requirements:
        return Requirements(
            samples_per_item=config.group_size,
            reference=config.kl_coef > 0,
            value_head=True,
            detach_value_trunk=config.detach_value_trunk,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
        )

    def __init__(self, config: Any, ctx: Any) -> None:
        super().__init__(config, ctx)
        self.kl = AdaptiveKL(config.kl_coef, config.kl_target, config.kl_horizon)

    @classmethod
    def param_groups(cls, config: Any, model: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
        return head_param_groups(model, lr, config.critic_lr if config.critic_lr is not None else 10 * lr)

    @property
    def kl_coef(self) -> float:
        return float(self.kl.value)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl.value = float(state.get("kl_coef", self.kl.value))

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, mask = self.cfg, batch.loss_mask
        rewards = token_rewards(batch.rewards, batch.step_rewards, batch.step_ends, batch.step_mask, mask)
        metrics: dict[str, float] = {"kl/coef": self.kl_coef}
        # batch statistics are global (summed over processes), so every process, and a single process
        # holding the union of their data, computes the same β, the same whitening and the same metrics
        total = self.ctx.sum_all
        n = max(total(mask.sum()), 1.0)
        if self.kl_coef > 0:
            kl = self.kl_estimate(batch.extras.need("old_logp"), batch.extras.need("ref_logp")) * mask
            seqs = total(float((mask.sum(-1) > 0).sum()))
            # under a sampler-trainer correction the estimate is weighted (`kl_weight`); the reward's penalty is
            # not: the policy loss's weight carries it
            w = self.kl_weight(batch)
            seq_kl = total((kl if w is None else kl * w).sum()) / max(seqs, 1.0)
            metrics["kl/sequence"] = seq_kl
            if cfg.kl_in == "reward":
                rewards = rewards - self.kl_coef * kl
            if cfg.adaptive_kl:
                self.kl.update(seq_kl, int(seqs))
        values = batch.extras.need("old_values")
        adv, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        metrics["critic/value_mean"] = total((values * mask).sum()) / n
        return_mean = total((returns * mask).sum()) / n
        metrics["critic/return_mean"] = return_mean
        var_r = total((((returns - return_mean) * mask) ** 2).sum()) / n
        if var_r > 0:  # fraction of the return variance the critic explains
            metrics["critic/explained_var"] = (
                1.0 - total((((returns - values) * mask) ** 2).sum()) / n / var_r
            )
        if cfg.whiten_advantages:  # over the global batch's action tokens, as one process would
            # unbiased variance (÷ (n − 1)), as verl's masked_whiten that Search-R1's PPO runs on
            mean = total((adv * mask).sum()) / n
            var = total((((adv - mean) * mask) ** 2).sum()) / max(n - 1.0, 1.0)
            adv = (adv - mean) * torch.rsqrt(torch.tensor(var + 1e-8)) * mask
        batch.extras.advantages = adv * mask
        batch.extras.returns = returns
        return metrics

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        if values is None:
            raise RuntimeError("PPO needs the value head's outputs; the trainer passes them")
        pg, metrics = batch_policy_loss(cfg, logp, mb)
        if self.step < cfg.critic_warmup_steps:
            pg = pg * 0.0
        vloss, vmetrics = clipped_value_loss(
            values, mb.extras.need("old_values"), mb.extras.need("returns"), cfg.value_clip
        )
        metrics.update(vmetrics, pg_loss=pg.detach(), value_loss=vloss.detach())
        return self.with_kl(pg + cfg.vf_coef * vloss, metrics, logp, entropy, mb)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²) per token; ``clip`` 0 or inf: unclipped."""
    unclipped = (values - returns) ** 2
    if clip <= 0 or math.isinf(clip):
        return 0.5 * unclipped, {"value_clip_frac": torch.zeros_like(values)}
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"value_clip_frac": (clipped > unclipped).float()}
