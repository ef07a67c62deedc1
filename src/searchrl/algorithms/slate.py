"""SLATE: truncated step-level sampling with step-group advantages and dense judge rewards
(SLATE paper §3, eq. 3-7, Appendix A.1 Algorithm 1).

Per question, at step t = 1, 2, … ≤ B:

1. sample k candidate next actions from the shared prefix τ<t (eq. 3) — think + search, or think + answer;
   each candidate's search is run, so the judge sees what its query retrieves;
2. score each with a judge (`rewards.judges`): r = r_think + r_query for a search (eq. 5),
   r = r_think + r_answer + λ·(B − t)/B for an answer (eq. 6, t counted from 1), each part in {−1, 0, +1};
   a malformed action scores r_think − 1, without the bonus;
3. step-group advantage A = (r − mean_k r) / (std_k r + ε) (eq. 4);
4. pick the continuation j* ~ softmax(A/η) (``selection: weighted``, η = 0.7) or argmax r (``best``),
   append it and its observation to the prefix; stop at an answer or after B steps.

Every candidate becomes one training sample: the prefix as context (no loss) followed by the candidate's
action tokens, which alone carry loss. The objective is eq. 7, the clipped ratio with the candidate's
advantage on its own tokens, averaged over candidates (``loss_agg: seq-mean-token-mean``: the 1/Σ I(y_l)
of eq. 7 per candidate, then the mean over the candidates and steps of the batch), minus β·KL on
generated tokens only. Only the collection differs from GRPO; the loss and the advantage of eq. 4 are
GRPO's with one group per (question, step).

Each question yields up to k·B samples; the trainer fills unused slots with empty rows (no loss tokens, no
reward) so every process runs the same number of micro-batches.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from searchrl.algorithms.base import Requirements
from searchrl.algorithms.grpo import GRPO, GroupPolicyConfig
from searchrl.algorithms.objective import LossAgg, declared
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, setting
from searchrl.core.types import Segment, Step, Trajectory
from searchrl.rewards.judges import JUDGES, JudgeItem, JudgeScores
from searchrl.rollout.loop import RolloutStats, start_trajectories
from searchrl.rollout.step_search import step_search

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


# one candidate's step-group advantage is always 0: the group normalises over the k candidates
AT_LEAST_2: Range = (lambda v: v >= 2, "at least 2 (candidates per step; SLATE uses 5)")


@dataclass(frozen=True)
class SLATEConfig(GroupPolicyConfig):
    k: int = setting(5, "candidates per step (SLATE §5.3)", AT_LEAST_2)
    eta: float = setting(0.7, "temperature of the reward-weighted selection", POSITIVE)
    selection: Literal["weighted", "best"] = setting(
        "weighted", "which candidate continues: sampled by reward-weighted softmax, or the best"
    )
    budget: int | None = setting(
        None, "B, the action budget; null: env.max_turns + 1 (the forced answer included)", AT_LEAST_1
    )
    bonus: float = setting(0.1, "λ of the early-termination bonus", AT_LEAST_0)
    judge: str = setting("rule", "the judge that scores each step (a registered judge)", registry="judges")
    judge_args: dict[str, Any] = setting(dict, "the judge's keyword arguments")
    loss_agg: LossAgg = setting(
        "seq-mean-token-mean", "how token losses become the batch's loss (SLATE: each candidate's token mean)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # k's range too: its step group normalises over the k candidates
        # a SLATE row is one step already: its group is its step group
        if getattr(declared(self.advantage), "level", None) == "turn":
            raise ValueError(
                f"advantage '{self.advantage}' credits the steps of whole episodes; a SLATE row is one step "
                "and its candidates already form its step group (eq. 4): use grpo, or algorithm grpo"
            )


def step_reward(
    scores: JudgeScores, kind: str, t: int, budget: int, bonus: float, valid: bool = True
) -> float:
    """Eq. 5 for searches, eq. 6 for answers (t counted from 1), r_think + r_answer (−1) for malformed actions.
    The early-termination bonus rewards finishing with an answer, so an answer the environment rejected
    (text after it, two answers, an empty one) gets none."""
    if kind == "search":
        return scores.think + scores.query
    if kind == "answer" and valid:
        return scores.think + scores.answer + bonus * (budget - t) / budget
    return scores.think + scores.answer


def select(rewards: list[float], advantages: list[float], how: str, eta: float, rng: random.Random) -> int:
    """Best-of-k (first argmax of r), or j* ~ softmax(A / η)."""
    if how == "best":
        return max(range(len(rewards)), key=lambda j: rewards[j])
    top = max(advantages)
    w = [math.exp((a - top) / eta) for a in advantages]
    return rng.choices(range(len(w)), weights=w)[0]


def candidate_sample(kid: Trajectory) -> Trajectory:
    """The prefix (context, no loss) and the candidate's action (its last step): one training sample."""
    step = kid.steps[-1]
    prefix_ids, action = kid.state_ids(), kid.segments[step.segment]
    out = Trajectory(
        kid.example, [Segment("prompt", prefix_ids), action], state=kid.state, finish_reason=kid.finish_reason
    )
    out.steps = [Step(segment=1, last_token=len(prefix_ids) + len(action.token_ids) - 1, info=step.info)]
    return out


class SLATE(GRPO):
    episodic = False  # each step's continuation is chosen from its candidates' rewards
    Config = SLATEConfig

    def __init__(self, config: Any, ctx: Any) -> None:
        super().__init__(config, ctx)
        self.judge = JUDGES.get(config.judge)(**config.judge_args)

    @classmethod
    def requires(cls, config: SLATEConfig, env: EnvConfig) -> Requirements:  # type: ignore[override]
        """Up to k candidates at each of the B steps of a question: k·B rows per question."""
        k_b = config.k * budget_of(config, env.max_turns)
        return Requirements(
            samples_per_item=k_b,
            reference=config.kl_coef > 0,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
        )

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        c, cfg = self.ctx, self.cfg
        B = budget_of(cfg, c.env.max_turns)
        examples = [c.train_examples[i] for i in indices]
        samples: list[list[Trajectory]] = [[] for _ in examples]
        stats = RolloutStats()
        rewards: list[float] = []
        failures = 0

        def choose(q: int, t: int, prefix: Trajectory, group: list[Trajectory], judged: list[Any]) -> int:
            nonlocal failures
            failures += sum(s.failed for s in judged)
            infos = [kid.steps[-1].info for kid in group]
            r = [step_reward(s, i.kind, t, B, cfg.bonus, i.valid) for i, s in zip(infos, judged)]
            rewards.extend(r)
            for kid, rj in zip(group, r):
                sample = candidate_sample(kid)
                sample.reward = rj
                sample.group_id = indices[q] * (B + 1) + t  # one group per (question, step)
                samples[q].append(sample)
            rng = random.Random(hash((self.step, indices[q], t)))
            return select(r, step_advantages(r, cfg.eps), cfg.selection, cfg.eta, rng)

        prefixes = step_search(
            start_trajectories(c.env, c.tokenizer, examples),
            cfg.k,
            lambda pairs: self.judge([JudgeItem.of(p, kid) for p, kid in pairs]),
            choose,
            c.env,
            c.generator,
            c.tokenizer,
            c.sampling,
            c.max_total_tokens,
            stats,
            max_steps=B,
        )
        from searchrl.core.answers import exact_match

        n = len(prefixes)
        metrics = {
            **stats.metrics(),
            "slate/step_reward": Mean(sum(rewards), len(rewards)),
            "slate/candidates": Sum(len(rewards)),
            "slate/judge_failures": Sum(failures),
            "slate/answered": Mean(sum(p.answer is not None for p in prefixes), n),
            "slate/em": Mean(sum(exact_match(p.answer or "", p.example.answers) for p in prefixes), n),
            "slate/steps_per_question": Mean(len(rewards), cfg.k * n),
        }
        if (
            c.rewards is not None
        ):  # the experiment's outcome rewards on the episodes SLATE built, for comparison
            metrics.update(c.rewards(prefixes))
        # fewer than k·B samples per question when episodes end early: the trainer pads the rest
        return [sample for got in samples for sample in got], metrics


def step_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """Eq. 4: (r − mean) / (std + ε) within the k candidates of one step (unbiased std, as GRPO's)."""
    import torch

    from searchrl.algorithms.advantage_math import grpo_outcome

    r = torch.tensor(rewards, dtype=torch.float64)
    return grpo_outcome(r, torch.zeros(len(rewards), dtype=torch.long), eps=eps).tolist()


def budget_of(config: Any, max_turns: int) -> int:
    return int(config.budget) if config.budget is not None else max_turns + 1
