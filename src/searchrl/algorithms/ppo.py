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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from searchrl.algorithms.advantage_math import gae, token_rewards
from searchrl.algorithms.base import Algorithm, Requirements, check_group_size, head_param_groups
from searchrl.algorithms.correction import RolloutCorrection
from searchrl.algorithms.loss_terms import check_clip, check_stabilisers
from searchrl.algorithms.policy_losses import batch_policy_loss, check_policy_loss
from searchrl.core.types import RolloutBatch

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class PPOConfig:
    gamma: float = 1.0
    lam: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = (
        None  # c > 1: negative-advantage losses capped at −c·A (verl's clip_ratio_c = 3)
    )
    value_clip: float = 0.2  # 0 turns value clipping off
    vf_coef: float = 0.5
    critic_lr: float | None = None  # the value head's learning rate; None: 10 × trainer.lr
    critic_warmup_steps: int = 0  # steps that train only the critic (the policy loss is 0)
    detach_value_trunk: bool = False  # True: the value loss trains the head only, not the shared LM
    whiten_advantages: bool = True
    kl_coef: float = 0.001  # β; 0 skips the reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_clamp: float | None = None  # bound each token's KL estimate to ±kl_clamp (verl: 10); None: unbounded
    kl_in: Literal["reward", "loss"] = "reward"
    adaptive_kl: bool = False  # Ziegler et al. (2019): β follows the measured KL towards kl_target
    kl_target: float = 0.01
    kl_horizon: int = 10000
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"] = (
        "token-mean"
    )
    group_size: int = 1  # rollouts per question (Search-R1's PPO: one; the critic needs no group)
    # sampler-trainer importance weights or masks on the policy loss (`algorithms.correction`)
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    # the policy loss on GAE's advantages (`algorithms.policy_losses`): clip (the papers'), gspo_token, cispo, …
    policy_loss: str = field(default="clip", metadata={"registry": "policy_losses"})
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages (TRL's default)
    sapo_tau_neg: float = 1.05  # … and for the others (TRL's default)

    def __post_init__(self) -> None:
        check_clip(self.clip_low, self.clip_high)
        check_stabilisers(self.dual_clip, self.kl_clamp)
        check_group_size(self.group_size)
        check_policy_loss(
            self.policy_loss, self.loss_agg, self.dual_clip, (self.sapo_tau_pos, self.sapo_tau_neg)
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
