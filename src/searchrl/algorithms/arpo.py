"""ARPO: entropy-based adaptive rollouts that branch after tool responses (Dong et al. 2025, arXiv 2507.19849, §3).

Per question, with a global budget of M rows (``group_size``) and N initial chains (``initial_rollouts``):

1. **Rollout initialisation** (§3.2 (1)): N chains sampled whole; the entropy of each chain's first step,
   H_initial, is its reference (a branch inherits its chain's).
2. **Entropy variation monitoring** (§3.2 (2)): after the observation of a tool call t, the step that follows
   opens with k tokens (``entropy_tokens``) whose entropy H_t is read from the sampler;
   ΔH_t = (H_t − H_initial) / log |V| (H: the sum over the k tokens of H(π_T) at each, as the released code
   sums it; /log |V| its normalisation).
3. **Entropy-based adaptive beaming** (§3.2 (3)): each of Z − 1 candidate branches (``beam_size`` Z) at that
   point is taken with probability P_t = clip(τ + β·ΔH_t, 0, 1): the released code draws u ~ U(0, 1) per
   candidate and branches when clip(u − β·ΔH_t, 0, 1) ≤ τ (``branch_probability`` τ, ``entropy_weight`` β;
   the paper's α is that draw). A branch is the chain up to the observation of t, its token ids as sampled, the
   environment state rebuilt by replay (`tree_grpo.node_prefix`), continued to its end; its own steps are
   candidate points of the next round. Points are visited in the order of the released code's rounds: by
   tool call, then chain.
4. **Termination** (§3.2 (4)): when the question's M − N branch budget is spent or no point branches; rows
   still missing are filled with fresh chains (trajectory-level samples), so every question yields M rows.

The rows of a question are one group. **Advantage attribution** (§3.3): ``soft`` (the paper's default): GRPO
over the M rows, each row trained on its whole path, so a prefix shared by k rows is trained k times with each
row's advantage; ``hard``: a token that k rows share (the same ids from the prompt up to it) gets the mean of
their advantages, Â_{i,t} = mean_{j : y_j[:t] = y_i[:t]} Â_j.

Where the released code (``vllm_rollout_with_tools.py``) and this differ: there, branching happens in flight
from the entropy of the step that *made* the call, and a branch's H_initial is its own first step; here the
original chain runs to its end first, and the paper's definition (the k tokens after the tool response,
against the chain's first step) decides. The entropy is the full-vocabulary H(π_T) on the HF backends and the
sum over vLLM's top-20 log-probs there (the released code: top-10).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from searchrl.algorithms.base import Requirements
from searchrl.algorithms.grpo import GRPO, GRPOConfig
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import AT_LEAST_0, AT_LEAST_1, ZERO_TO_ONE, setting
from searchrl.core.types import RolloutBatch, Trajectory

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class ARPOConfig(GRPOConfig):
    group_size: int = setting(
        8, "M, the global rollout budget per question (the paper's 7B reasoning runs: 16)", AT_LEAST_1
    )
    initial_rollouts: int = setting(
        4, "N, chains sampled whole (the paper's 7B reasoning runs: 8)", AT_LEAST_1
    )
    beam_size: int = setting(
        2, "Z: a branching point spawns up to Z − 1 branches (the released scripts: 2)", AT_LEAST_1
    )
    branch_probability: float = setting(0.5, "τ (the released scripts: 0.5)", ZERO_TO_ONE)
    entropy_weight: float = setting(0.2, "β (the released scripts: 0.2)", AT_LEAST_0)
    entropy_tokens: int = setting(
        20, "k, tokens after a tool response whose entropy is read (the released code: 20)", AT_LEAST_1
    )
    attribution: Literal["soft", "hard"] = setting("soft", "§3.3: soft (the paper's default) or hard")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.initial_rollouts > self.group_size:
            raise ValueError(
                f"arpo: initial_rollouts must be at most group_size ({self.group_size}), got {self.initial_rollouts}"
            )
        if self.dynamic_sampling.enabled:
            raise ValueError("arpo builds its own groups: dynamic_sampling does not apply to it")
        if self.attribution == "hard" and self.advantage != "grpo":
            raise ValueError(
                f"arpo's hard attribution averages GRPO's advantages over shared prefixes; advantage "
                f"'{self.advantage}' does not apply: use advantage grpo or attribution soft"
            )


def branch_taken(u: float, delta_h: float, tau: float, beta: float) -> bool:
    """The released code's rule for one candidate branch: clip(u − β·ΔH, 0, 1) ≤ τ, u ~ U(0, 1)."""
    return min(1.0, max(0.0, u - beta * delta_h)) <= tau


def check_entropy(chains: list[Trajectory], name: str) -> None:
    """Refuses chains whose generator recorded no sampling entropy (ARPO and AEPO read it)."""
    if chains and chains[0].steps and step_entropy(chains[0], 0) is None:
        raise RuntimeError(
            f"{name} reads the sampler's entropy after each tool response, and this generator recorded none "
            "(rollout.compile's captured step does not): set rollout.compile false"
        )


def step_entropy(t: Trajectory, s: int) -> float | None:
    """H of step ``s`` of ``t``: the sum over its first tokens' recorded entropies (None: not recorded)."""
    from searchrl.rollout.episode import STEP_ENTROPY

    ents = t.info.get(STEP_ENTROPY)
    return float(sum(ents[s])) if ents is not None and s < len(ents) else None


def branch_points(t: Trajectory, start: int) -> list[int]:
    """The steps s ≥ ``start`` of ``t`` whose observation the episode went on from: ARPO's points after a tool
    response, each with the entropy of the step s + 1 that followed."""
    out = []
    for s in range(start, len(t.steps) - 1):
        nxt = t.steps[s].segment + 1
        if nxt < len(t.segments) and t.segments[nxt].kind == "observation":
            out.append(s)
    return out


def shared_prefix_mean(adv: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """§3.3's hard attribution: each token's advantage is the mean over the rows of its group whose ids equal
    its row's from position 0 through it. ``adv`` (B,) per row → (B, T) on the action tokens."""
    B, T = batch.input_ids.shape
    out = adv[:, None].expand(B, T).clone()
    for g in batch.group_ids[batch.group_ids >= 0].unique().tolist():
        rows = (batch.group_ids == g).nonzero().flatten()
        ids, real = batch.input_ids[rows], batch.attention_mask[rows].bool()
        same = (ids[:, None, :] == ids[None, :, :]) & real[:, None, :] & real[None, :, :]  # (G, G, T)
        shared = same.long().cumprod(-1).float()  # rows i, j identical from 0 through t
        out[rows] = (shared * adv[rows][None, :, None]).sum(1) / shared.sum(1).clamp_min(1.0)
    return out * batch.loss_mask


class ARPO(GRPO):
    Config: ClassVar[type] = ARPOConfig
    episodic = False  # rows come from branches built in `collect`, not from the rollout worker's chains

    @classmethod
    def requires(cls, config: ARPOConfig, env: EnvConfig) -> Requirements:  # type: ignore[override]
        return Requirements(
            samples_per_item=config.group_size,
            reference=config.kl_coef > 0,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
        )

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        from searchrl.rollout.episode import RolloutStats
        from searchrl.rollout.loop import start_trajectories

        c, cfg = self.ctx, self.cfg
        if c.generator is None or c.rewards is None:
            raise RuntimeError("arpo collects episodes: the trainer gives it a generator")
        sampling = replace(c.sampling, entropy_tokens=cfg.entropy_tokens)
        examples = [c.train_examples[i] for i in indices]
        stats = RolloutStats()
        metrics: dict[str, Any] = {}
        initial = self.initial_rollouts(examples, sampling, stats, metrics)
        rows: list[list[Trajectory]] = [
            start_trajectories(c.env, c.tokenizer, [ex], n, first_group=q)
            for q, (ex, n) in enumerate(zip(examples, initial, strict=True))
        ]
        chains = [t for group in rows for t in group]
        self._run(chains, sampling, stats)
        check_entropy(chains, type(self).__name__.lower())
        # row (by id) -> its question's index here, and its H_initial (its chain's first step's entropy)
        question = {id(t): q for q, group in enumerate(rows) for t in group}
        h_init = {id(t): step_entropy(t, 0) or 0.0 for t in chains}
        budget = [cfg.group_size - n for n in initial]
        rng = random.Random(f"arpo:{self.step}:{indices}")
        # branched: the (question, tool call) points where a branch was taken (AEPO's consecutive-branch penalty)
        tally: dict[str, Any] = {"points": 0, "branches": 0, "tokens": 0, "deltas": [], "branched": set()}
        frontier = [(t, 0) for t in chains]  # rows whose steps from this one on are candidate points
        while frontier and any(b > 0 for b in budget):
            kids = self._branch_round(frontier, question, h_init, budget, rng, tally)
            if not kids:
                break
            before = sum(k.episode.generated_tokens for k, _ in kids)
            self._run([k for k, _ in kids], sampling, stats)
            tally["tokens"] += sum(k.episode.generated_tokens for k, _ in kids) - before
            for kid, _ in kids:
                rows[question[id(kid)]].append(kid)
            tally["branches"] += len(kids)
            frontier = kids
        fill = [
            (q, start_trajectories(c.env, c.tokenizer, [examples[q]], cfg.group_size - len(group)))
            for q, group in enumerate(rows)
            if len(group) < cfg.group_size
        ]
        self._run([t for _, new in fill for t in new], c.sampling, stats)  # the budget no branch took
        for q, new in fill:
            rows[q].extend(new)
        out = [t for group in rows for t in group]
        for q, group in enumerate(rows):
            for t in group:
                t.group_id = indices[q]
        metrics.update({**stats.metrics(), **c.rewards(out)})
        metrics["arpo/branch_points"] = Sum(tally["points"])
        metrics["arpo/branches"] = Sum(tally["branches"])
        metrics["arpo/fresh_rows"] = Sum(sum(len(new) for _, new in fill))
        metrics["arpo/entropy_delta"] = Mean(sum(tally["deltas"]), len(tally["deltas"]))
        metrics["arpo/branch_tokens"] = Sum(tally["tokens"])
        metrics["arpo/generated_tokens_per_row"] = Mean(
            sum(t.episode.generated_tokens for t in out), len(out)
        )
        return self.finish(out, metrics)

    def initial_rollouts(
        self, examples: list[Any], sampling: Any, stats: Any, metrics: dict[str, Any]
    ) -> list[int]:
        """N, the chains each question starts with: ``initial_rollouts`` for every question."""
        return [self.cfg.initial_rollouts] * len(examples)

    def takes_branch(self, u: float, delta: float, q: int, s: int, tally: dict[str, Any]) -> bool:
        """Whether a candidate branch of question ``q`` after tool call ``s`` is taken, for draw ``u``."""
        return branch_taken(u, delta, self.cfg.branch_probability, self.cfg.entropy_weight)

    def _run(self, trajs: list[Trajectory], params: Any, stats: Any) -> None:
        from searchrl.rollout.loop import run

        c = self.ctx
        if trajs:
            assert c.generator is not None
            run(trajs, c.env, c.generator, c.tokenizer, params, c.max_total_tokens, stats=stats)

    def _branch_round(
        self,
        frontier: list[tuple[Trajectory, int]],
        question: dict[int, int],
        h_init: dict[int, float],
        budget: list[int],
        rng: random.Random,
        tally: dict[str, Any],
    ) -> list[tuple[Trajectory, int]]:
        """One round of §3.2 (2)-(3): the candidate points of ``frontier``'s rows by tool call, then row; each
        point's ΔH and its Z − 1 draws; the branches taken, as live prefixes (budget spent per question)."""
        from searchrl.algorithms.tree_grpo import node_prefix
        from searchrl.rollout.episode import STEP_ENTROPY

        cfg = self.cfg
        log_v = math.log(max(len(self.ctx.tokenizer), 2))
        candidates = sorted(
            ((s, i, t) for i, (t, start) in enumerate(frontier) for s in branch_points(t, start)),
            key=lambda x: (x[0], x[1]),
        )
        kids: list[tuple[Trajectory, int]] = []
        for s, _, t in candidates:
            q = question[id(t)]
            if budget[q] <= 0:
                continue
            tally["points"] += 1
            delta = ((step_entropy(t, s + 1) or 0.0) - h_init[id(t)]) / log_v
            tally["deltas"].append(delta)
            for _ in range(min(cfg.beam_size - 1, budget[q])):
                if not self.takes_branch(rng.random(), delta, q, s, tally):
                    continue
                tally["branched"].add((q, s))
                kid = node_prefix(t, s, self.ctx.env)
                kid.info[STEP_ENTROPY] = [list(e) for e in t.info.get(STEP_ENTROPY, [])[: s + 1]]
                kid.info["arpo_branch_step"] = s + 1  # the steps it shares with the row it branched from
                question[id(kid)], h_init[id(kid)] = q, h_init[id(t)]
                budget[q] -= 1
                kids.append((kid, s + 1))
        return kids

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """GRPO's advantages over the question's M rows (soft attribution); with ``attribution: hard``, the
        tokens rows share get the mean of their advantages (`shared_prefix_mean`)."""
        metrics = super().prepare(batch)
        if self.cfg.attribution == "hard":
            adv = batch.extras.need("advantages")
            first = (batch.loss_mask > 0).float().argmax(-1)  # a sequence-level advantage: any action token
            row = adv.gather(1, first[:, None]).squeeze(1) * (batch.loss_mask.sum(-1) > 0)
            batch.extras.advantages = shared_prefix_mean(row, batch)
        return metrics
