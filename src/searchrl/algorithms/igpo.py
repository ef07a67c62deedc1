"""IGPO: information-gain turn rewards (Wang et al. 2025, arXiv 2510.14967, ICLR 2026; released code:
``GuoqingWang1/IGPO``, a verl fork).

An advantage estimator for GRPO (``algorithm: {name: grpo, advantage: igpo}``). Each turn is rewarded by how much
it raised the policy's own belief in the gold answer a:

- the belief after a context c is π_θ(a | c) = exp((1/L) Σ_j log π_θ(a_j | c, a_<j)) (§3.1), the gold answer
  teacher-forced after the context and the environment's answer wrapper (`answer_probe`; IGPO's code appends
  "Now there's enough information to answer </think> <answer> a </answer>"), its L tokens scored. The trainer
  computes it with the policy before the update, in the same batched no-grad pass as π_old's log-probs
  (`searchrl.engine.step`, ``Requirements.probes``);
- turn t < T gets r_t = π_θ(a | c_t) − π_θ(a | c_{t−1}) (eq. 4; ``gain: logprob`` takes the difference of the mean
  log-probs instead, IGPO's ``log_prob_diff``), c_0 the prompt and c_t everything up to turn t+1's action; the
  last turn T gets the outcome reward (eq. 5); a turn's process reward, where one is configured, is added to it;
- ``baseline: group`` (IGPO's ``joint`` mode): every turn reward of a question's G episodes is normalised
  together, r̂ = (r − μ) / (σ + ε) with σ the population std (1 for a lone reward; μ only with
  ``std_normalize: false``), then the turn advantage is the discounted sum Ã_t = Σ_{k≥t} γ^{k−t} r̂_k (eq. 6), on
  every action token of the turn. IGPO's code leaves out of μ and σ the information gains that are exactly 0;
  here every turn counts.
- ``baseline: turn``: the per-turn leave-one-out baseline. The return G_{i,t} = Σ_{k≥t} γ^{k−t} r_{i,k} less the
  mean return at the same turn index over the question's *other* episodes that reached it (0 where none did).
  Turns of different episodes are not exchangeable (their histories differ), so this baseline conditions only on
  the question and the turn index; it does not depend on episode i, so the gradient stays unbiased (a pooled
  baseline includes the turn's own reward and mixes turn positions and outcome rewards). No std scaling.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Literal

import torch

from searchrl.algorithms.advantage_math import discounted_by_slot, steps_to_tokens
from searchrl.algorithms.base import PROBE_KEY
from searchrl.algorithms.objective import advantage_estimator
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import ZERO_TO_ONE, check_ranges, setting

if TYPE_CHECKING:
    from searchrl.algorithms.advantage_estimators import AdvantageInput
    from searchrl.algorithms.base import Probe
    from searchrl.core.types import RolloutBatch, Trajectory


@dataclass(frozen=True)
class IGPOSettings:
    """``algorithm.igpo``: IGPO's own settings (defaults: its released code)."""

    gamma: float = setting(
        1.0, "γ of the turn-level discounted accumulation (eq. 6; IGPO's default 1.0)", ZERO_TO_ONE
    )
    gain: Literal["prob", "logprob"] = setting(
        "prob", "the belief as a probability (IGPO's prob_diff) or as the answer's mean log-prob"
    )
    baseline: Literal["group", "turn"] = setting(
        "group", "IGPO's pooled group normalisation, or a per-turn leave-one-out baseline"
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.gain not in ("prob", "logprob"):
            raise ValueError(f"igpo.gain must be 'prob' or 'logprob', got {self.gain!r}")
        if self.baseline not in ("group", "turn"):
            raise ValueError(f"igpo.baseline must be 'group' or 'turn', got {self.baseline!r}")


def split_gold(text: str, gold: str) -> tuple[str, str, str]:
    """``text`` as (before, the gold answer's last occurrence with the space before it, after)."""
    i = text.rfind(gold)
    if i < 0:
        raise ValueError(f"the answer probe {text!r} does not contain the answer {gold!r}")
    start = i - 1 if i > 0 and text[i - 1] == " " else i
    return text[:start], text[start : i + len(gold)], text[i + len(gold) :]


def answer_probes(trajs: list[Trajectory], batch: RolloutBatch, env: Any, tokenizer: Any) -> list[Probe]:
    """One probe per step of every row with at least two steps: the tokens before the step's first action
    token, then the gold answer (the example's first) as the environment writes an answer (`answer_probe`),
    scored on the answer's own tokens. Each piece is tokenized on its own, so the scored tokens are exactly
    the answer's; nothing after the answer is needed (the model is causal)."""
    from searchrl.algorithms.base import Probe

    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []  # noqa: E731
    cache: dict[str, tuple[list[int], list[int]]] = {}
    out: list[Probe] = []
    for b, traj in enumerate(trajs):
        if int(batch.group_ids[b]) < 0 or not traj.example.answers:
            continue
        slots = batch.step_mask[b].nonzero().flatten().tolist()
        if len(slots) < 2:
            continue
        gold = traj.example.answers[0]
        if gold not in cache:
            before, mid, _ = split_gold(env.answer_probe(gold), gold)
            cache[gold] = (enc(before), enc(mid))
        lead, answer = cache[gold]
        sid = batch.step_ids[b]
        for k in slots:
            start = int((sid == k).nonzero()[0])
            ctx = batch.input_ids[b, :start].tolist() + lead
            out.append(Probe(b, k, ctx + answer, len(ctx), len(ctx) + len(answer)))
    return out


def turn_rewards(x: AdvantageInput, batch: RolloutBatch, gain: str) -> list[dict[int, float]]:
    """Each row's turn rewards by step slot: the belief's gain across the turn (eq. 4), the outcome at the
    last turn (eq. 5), plus the turn's process reward."""
    beliefs = batch.extras.more.get(PROBE_KEY)
    outcome = x.penalised()
    out: list[dict[int, float]] = []
    for b in range(len(batch)):
        slots = batch.step_mask[b].nonzero().flatten().tolist() if int(batch.group_ids[b]) >= 0 else []
        r = {k: float(batch.step_rewards[b, k]) for k in slots}
        if slots:
            r[slots[-1]] += float(outcome[b])
        for k, nxt in pairwise(slots):
            if beliefs is None:
                raise ValueError(
                    "the igpo advantage reads the answer probes' log-probs: the trainer computes them"
                )
            lo, hi = float(beliefs[b, k]), float(beliefs[b, nxt])
            if math.isnan(lo) or math.isnan(hi):  # no probe (an example without a gold answer): no gain
                continue
            r[k] += (math.exp(hi) - math.exp(lo)) if gain == "prob" else (hi - lo)
        out.append(r)
    return out


@advantage_estimator("igpo", level="turn")
def igpo(x: AdvantageInput) -> torch.Tensor:
    """IGPO (arXiv 2510.14967): information-gain turn rewards, group-normalised and discounted (module docstring)."""
    batch = x.steps("igpo")
    s = x.cfg.igpo
    rewards = turn_rewards(x, batch, s.gain)
    groups: dict[int, list[int]] = defaultdict(list)
    for b in range(len(batch)):
        if int(batch.group_ids[b]) >= 0:
            groups[int(batch.group_ids[b])].append(b)
    turn_adv: list[dict[int, float]] = [{} for _ in range(len(batch))]
    for rows in groups.values():
        if s.baseline == "group":  # eq. 6 after the pooled normalisation (IGPO's joint mode)
            pool = torch.tensor([v for b in rows for v in rewards[b].values()], dtype=torch.float64)
            if not len(pool):
                continue
            mu = pool.mean()
            sigma = (((pool - mu) ** 2).mean() + 1e-8).sqrt() if len(pool) > 1 else torch.tensor(1.0)
            for b in rows:
                norm = {k: float(v - mu) for k, v in rewards[b].items()}
                if x.cfg.std_normalize:
                    norm = {k: v / float(sigma + x.cfg.eps) for k, v in norm.items()}
                turn_adv[b] = discounted_by_slot(norm, s.gamma)
            continue
        # the per-turn leave-one-out baseline: the question's other episodes' returns at the same turn index
        slots = {b: sorted(rewards[b]) for b in rows}
        returns = {b: [discounted_by_slot(rewards[b], s.gamma)[k] for k in slots[b]] for b in rows}
        for b in rows:
            for t, g in enumerate(returns[b]):
                others = [returns[j][t] for j in rows if j != b and len(returns[j]) > t]
                turn_adv[b][slots[b][t]] = g - sum(others) / len(others) if others else 0.0
    gains = [v for r in rewards for k, v in r.items() if k != max(r)]  # the turns before each episode's last
    x.metrics.update(
        {"igpo/turn_reward": Mean(sum(gains), len(gains)), "igpo/turns_rewarded": Sum(len(gains))}
    )
    return steps_to_tokens(turn_adv, batch.step_ids, x.loss_mask)
