"""AEPO: entropy-balanced rollouts and updates on ARPO's branching (Dong et al. 2025, arXiv 2510.14545, §4).

Three parts on top of ARPO (`algorithms.arpo`: N chains, branches after tool responses where the entropy rose,
GRPO over a question's M rows), each a key, traced to the released code (``dongguanting/ARPO``, ``AEPO/``,
commits 81e3a5d "upload AEPO" and 30efc15; ``vllm_rollout_with_tools.py`` and ``core_algos.py``):

1. **Dynamic entropy-balanced rollout, pre-monitoring** (``dynamic_rollouts``, §4.1): before the step's chains,
   one probe chain per question, sampled whole; H_root the entropy of its first step, H̄_tool the mean over its
   steps (the released code averages every step of the probe, its first included; each H the sum over the
   first k tokens' entropies, normalised by log |V| as ARPO's). The question's global samples

       m = clip(⌊M·σ(β_pre·(H_root − H̄_tool))⌋ + 1, 1, M)        (the paper's m = k·σ(β(H_root − H̄_tool)),
                                                                  rounded as the released code rounds it)

   replace ARPO's fixed N; the M − m rest is the branch budget. A question whose root is more uncertain than its
   tool steps gets more whole chains, one whose tool steps are more uncertain gets more branches. The probe
   chains are not trained (as released); their tokens count in ``rollout/tokens_generated``.
2. **Consecutive high-entropy branch penalty** (§4.1): a candidate branch of a question after tool call t is
   taken when clip((u + β·ΔH_t)·max(0, 1 − c·l), 0, 1) ≥ τ, u ~ U(0, 1), with l the number of tool calls just
   before t (t − 1, t − 2, …) at which the question already branched (the released code's per-question count of
   consecutive rounds that branched; c = ``branch_penalty``, 0.05 there). With l = 0 the probability is ARPO's
   clip(τ + β·ΔH_t) for τ = 0.5; each consecutive branching round lowers it.
3. **Entropy-balanced policy optimisation** (§4.2): the policy loss ``entropy_balanced``
   (`policy_losses.entropy_balanced`: the upper clip's gradient kept, rescaled), and the entropy-aware
   advantage (``entropy_advantage`` α, 0.2 in the released code)

       Â_t = A_t · (1 + α · sg((H_t − mean H) / std H))

   with H_t the policy's entropy at action token t in the update's forward, standardised over the micro-batch's
   action tokens (the released code's: per micro-batch of the update; std 0 → 1). Found in the released code:
   the entropy is computed there only when ``entropy_coeff`` ≠ 0, and every released config sets it to 0, so
   this term never applied in the released scripts; here it does whenever α > 0.

The released scripts turn (1) off (``ENABLE_DYNAMIC_ROLLOUTS=False``) and (3)'s two parts on; our default runs
all three, the paper's method. Where branching itself and this differ from the released in-flight rollout is
ARPO's note (`algorithms.arpo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from searchrl.algorithms.arpo import ARPO, ARPOConfig, check_entropy, step_entropy
from searchrl.algorithms.base import Requirements
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import AT_LEAST_0, setting

if TYPE_CHECKING:
    import torch

    from searchrl.core.config import EnvConfig
    from searchrl.core.types import RolloutBatch, Trajectory


@dataclass(frozen=True)
class AEPOConfig(ARPOConfig):
    dynamic_rollouts: bool = setting(
        True, "§4.1 entropy pre-monitoring: each question's global samples m from a probe chain's entropies"
    )
    premonitor_beta: float = setting(
        0.5, "β in m = M·σ(β·(H_root − H̄_tool)) (the released code: 0.5)", AT_LEAST_0
    )
    branch_penalty: float = setting(
        0.05,
        "c: a branch's probability times max(0, 1 − c·l), l consecutive branching tool calls",
        AT_LEAST_0,
    )
    entropy_advantage: float = setting(
        0.2,
        "α in Â = A·(1 + α·z(H)), the entropy-aware advantage (the released code: 0.2); 0: off",
        AT_LEAST_0,
    )
    policy_loss: str = setting(
        "entropy_balanced",
        "the policy loss: entropy_balanced (AEPO's entropy clipping-balanced surrogate) or any other "
        "(`algorithms.policy_losses`)",
        registry="policy_losses",
    )


def premonitored_rollouts(h_root: float, h_tool: float, budget: int, beta: float) -> int:
    """§4.1's global samples of a question: clip(⌊M·σ(β·(H_root − H̄_tool))⌋ + 1, 1, M), as the released code
    rounds it (``_calculate_initial_rollouts_dynamical``)."""
    x = beta * (h_root - h_tool)
    sigma = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))  # no overflow
    return max(1, min(int(budget * sigma) + 1, budget))


def penalized_branch_taken(u: float, delta_h: float, tau: float, beta: float, streak: int, c: float) -> bool:
    """The released AEPO rule for one candidate branch: clip((u + β·ΔH)·max(0, 1 − c·l), 0, 1) ≥ τ."""
    p = (u + beta * delta_h) * max(0.0, 1.0 - c * streak)
    return min(1.0, max(0.0, p)) >= tau


def streak(branched: set[tuple[int, int]], q: int, s: int) -> int:
    """l: how many tool calls just before ``s`` (s − 1, s − 2, …) question ``q`` branched at."""
    n = 0
    while (q, s - 1 - n) in branched:
        n += 1
    return n


def entropy_weighted(
    adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.2's entropy-aware advantage A·(1 + α·z), z the entropy standardised over ``mask``'s tokens (torch's
    unbiased std, as the released code; 0 → 1), detached; and z (0 off the mask)."""
    import torch

    on = mask > 0
    if int(on.sum()) == 0:
        return adv, torch.zeros_like(adv)
    h = entropy.detach()
    std = float(h[on].std()) if int(on.sum()) > 1 else 0.0
    z = (h - h[on].mean()) / (std if std != 0.0 else 1.0)
    z = torch.where(on, z, torch.zeros_like(z))
    return adv * (1.0 + alpha * z), z


class AEPO(ARPO):
    Config: ClassVar[type] = AEPOConfig
    _penalized = 0  # candidate branches whose probability the consecutive-branch penalty lowered

    @classmethod
    def requires(cls, config: AEPOConfig, env: EnvConfig) -> Requirements:  # type: ignore[override]
        return replace(super().requires(config, env), entropy=config.entropy_advantage > 0)

    def initial_rollouts(
        self, examples: list[Any], sampling: Any, stats: Any, metrics: dict[str, Any]
    ) -> list[int]:
        """With ``dynamic_rollouts``, each question's m from one probe chain's entropies (§4.1)."""
        from searchrl.rollout.loop import start_trajectories

        cfg, c = self.cfg, self.ctx
        if not cfg.dynamic_rollouts:
            return super().initial_rollouts(examples, sampling, stats, metrics)
        probes = start_trajectories(c.env, c.tokenizer, examples, 1)
        self._run(probes, sampling, stats)
        check_entropy(probes, "aepo")
        log_v = math.log(max(len(c.tokenizer), 2))
        out = []
        for t in probes:
            steps = [step_entropy(t, s) or 0.0 for s in range(len(t.steps))]
            h_root = steps[0] / log_v if steps else 0.0
            h_tool = sum(steps) / len(steps) / log_v if steps else h_root
            out.append(premonitored_rollouts(h_root, h_tool, cfg.group_size, cfg.premonitor_beta))
        metrics["aepo/initial_rollouts"] = Mean(sum(out), len(out))
        metrics["aepo/probe_tokens"] = Sum(sum(t.episode.generated_tokens for t in probes))
        return out

    def takes_branch(self, u: float, delta: float, q: int, s: int, tally: dict[str, Any]) -> bool:
        cfg = self.cfg
        n = streak(tally["branched"], q, s)
        self._penalized += n > 0
        return penalized_branch_taken(
            u, delta, cfg.branch_probability, cfg.entropy_weight, n, cfg.branch_penalty
        )

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        self._penalized = 0
        rows, metrics = super().collect(indices)
        metrics["aepo/penalized_branches"] = Sum(self._penalized)  # type: ignore[assignment]
        return rows, metrics

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss (``entropy_balanced`` by default) on the entropy-aware advantages (§4.2)."""
        from searchrl.algorithms.policy_losses import batch_policy_loss

        alpha = self.cfg.entropy_advantage
        adv = None
        if alpha > 0:
            if entropy is None:
                raise RuntimeError(
                    "aepo's entropy-aware advantage reads the policy's entropy; none was computed"
                )
            adv, z = entropy_weighted(mb.extras.need("advantages"), entropy, mb.loss_mask, alpha)
        loss, metrics = batch_policy_loss(self.cfg, logp, mb, advantages=adv)
        if adv is not None:
            metrics["aepo/entropy_z_abs"] = z.abs()
        return self.with_kl(loss, metrics, logp, entropy, mb)
