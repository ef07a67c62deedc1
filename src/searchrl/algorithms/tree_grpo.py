"""Tree-GRPO: tree rollouts whose nodes are whole agent steps (Ji et al. 2025, arXiv 2509.21240, §3).

Per question (Algorithm 1 of the paper):

1. **initialise** M trees, each one chain sampled from the prompt;
2. for L rounds, in every tree **sample** N nodes (a node: the episode up to the observation of one of its
   steps, or the prompt itself) and **expand** each: the policy continues from that node to a whole episode,
   a new leaf of the tree. A node's prefix is not generated again: the leaf is the node's tokens as sampled
   plus its new steps (the generator's prefix cache reuses the node's keys and values, `rollout.prefix_sharing`);
3. every leaf is a training row (its whole path: prompt, actions, observations), scored by the reward pipeline.

Each question yields M·(1 + L·N) leaves. The advantage of a leaf H (eqs. 7-9):

    A_intra(H) = (R(H) − mean_{T(H)} R) / std_{T(H)} R       over the leaves of H's tree
    A_inter(H) = (R(H) − mean_{q} R) / std_{q} R             over the leaves of all M trees of the question
    A(H)       = A_intra(H) + A_inter(H)

on every action token of H. A prefix shared by several leaves is trained once per leaf with each leaf's
advantage, so its steps receive the sum: the step-level preference signal of the paper's §3.3 (the
intra-tree objective equals step-level DPO between sibling branches). ``std_normalize: false`` drops the
stds. Node sampling is uniform over a tree's distinct nodes (with replacement when a tree has fewer than N);
trees of one question are ``group_id`` = question·M + tree, so the trainer's groups are trees.

Budget: a flat GRPO group of G chains generates G whole episodes; a tree's expansions generate only the
steps after their nodes (``tree/generated_tokens_per_leaf`` against GRPO's ``rollout/tokens_generated`` per
episode). Rows are whole paths, so the training step still runs the shared prefixes once per leaf.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from searchrl.algorithms.advantage_math import broadcast_to_tokens, grpo_outcome
from searchrl.algorithms.base import Requirements
from searchrl.algorithms.grpo import GRPO, GroupPolicyConfig
from searchrl.core.aggregate import Mean, Sum
from searchrl.core.config import AT_LEAST_0, AT_LEAST_1, setting
from searchrl.core.types import RolloutBatch, Trajectory

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class TreeGRPOConfig(GroupPolicyConfig):
    trees: int = setting(2, "M, trees per question", AT_LEAST_1)
    rounds: int = setting(1, "L, expansion rounds", AT_LEAST_0)
    expansions: int = setting(2, "N, nodes expanded per tree and round", AT_LEAST_1)

    def __post_init__(self) -> None:
        super().__post_init__()  # the ranges of trees, rounds and expansions too
        if self.advantage != "grpo":
            raise ValueError(
                f"tree_grpo computes its own intra- and inter-tree advantage (eq. 9); advantage "
                f"'{self.advantage}' does not apply: leave advantage at grpo"
            )

    @property
    def leaves(self) -> int:
        """Leaves per tree: the initial chain and one per expansion."""
        return 1 + self.rounds * self.expansions


def node_prefix(leaf: Trajectory, t: int, env: Any) -> Trajectory:
    """A live copy of ``leaf`` up to the observation of its step ``t`` (t = −1: the prompt alone), ready to
    continue: its segments and steps so far (token ids as sampled), and the environment state rebuilt from
    its recorded actions and observations (`SearchEnv.replay`: nothing is retrieved again), with the documents
    those steps retrieved."""
    state = leaf.episode
    n = t + 1
    seg_end = leaf.steps[t].segment + 2 if n else 1  # the step's action segment and its observation
    kid = copy.copy(leaf)
    kid.segments = list(leaf.segments[:seg_end])
    kid.steps = list(leaf.steps[:n])
    kid.step_rewards, kid.reward, kid.finish_reason = [], 0.0, None
    kid.info = {"tree_node": n}  # the steps the leaf took over from its node (0: the prompt alone)
    new = env.replay(leaf.example, list(state.actions[:n]), list(state.observations[:n]))
    new.retrieved = [list(d) for d in state.retrieved[:n]]
    new.prefetched = state.prefetched
    new.generated_tokens = sum(len(s.token_ids) for s in kid.segments if s.kind == "action")
    kid.state = new
    return kid


def nodes(tree: list[Trajectory]) -> list[tuple[int, int]]:
    """A tree's distinct expandable nodes as (leaf index, step): the prompt, and every step of a leaf that an
    observation followed (a step the episode went on from); nodes shared by several leaves listed once."""
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, int]] = []
    for i, leaf in enumerate(tree):
        for t in range(-1, len(leaf.steps)):
            if t >= 0:
                nxt = leaf.steps[t].segment + 1
                if nxt >= len(leaf.segments) or leaf.segments[nxt].kind != "observation":
                    continue  # an answer, or a step the episode stopped at: nothing to continue from
            end = leaf.steps[t].segment + 2 if t >= 0 else 1
            key = tuple(tok for s in leaf.segments[:end] for tok in s.token_ids)
            if key not in seen:
                seen.add(key)
                out.append((i, t))
    return out


def tree_advantages(
    rewards: torch.Tensor, tree_ids: torch.Tensor, trees: int, std_normalize: bool, eps: float
) -> torch.Tensor:
    """Eq. 9: A_intra (within each tree: ``tree_ids``) + A_inter (within each question: tree id // M). (B,)."""
    intra = grpo_outcome(rewards, tree_ids, std_normalize, eps)
    question = torch.where(tree_ids >= 0, tree_ids // trees, tree_ids)  # padding rows keep their own ids
    inter = grpo_outcome(rewards, question, std_normalize, eps)
    return intra + inter


class TreeGRPO(GRPO):
    Config: ClassVar[type] = TreeGRPOConfig
    episodic = False  # rows come from trees built in `collect`, not from the rollout worker's chains

    @classmethod
    def requires(cls, config: TreeGRPOConfig, env: EnvConfig) -> Requirements:  # type: ignore[override]
        return Requirements(
            samples_per_item=config.trees * config.leaves,
            reference=config.kl_coef > 0,
            old_in_prepare=config.kl_in == "reward" and config.kl_coef > 0,
        )

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        from searchrl.rollout.episode import RolloutStats
        from searchrl.rollout.loop import run, start_trajectories

        c, cfg = self.ctx, self.cfg
        if c.generator is None or c.rewards is None:
            raise RuntimeError("tree_grpo collects episodes: the trainer gives it a generator")
        examples = [c.train_examples[i] for i in indices]
        chains = start_trajectories(c.env, c.tokenizer, examples, cfg.trees)
        stats = RolloutStats()
        run(chains, c.env, c.generator, c.tokenizer, c.sampling, c.max_total_tokens, stats=stats)
        trees = [[chain] for chain in chains]  # tree q·M + m: the question's m-th chain
        rng = random.Random(f"tree:{self.step}:{indices}")
        expanded_from: list[int] = []
        expansion_tokens = 0
        for _ in range(cfg.rounds):
            kids, owners = [], []
            for ti, tree in enumerate(trees):
                candidates = nodes(tree)
                picks = (
                    rng.sample(candidates, cfg.expansions)
                    if len(candidates) >= cfg.expansions
                    else [rng.choice(candidates) for _ in range(cfg.expansions)]
                )
                for li, t in picks:
                    kids.append(node_prefix(tree[li], t, c.env))
                    owners.append(ti)
                    expanded_from.append(t + 1)
            before = sum(k.episode.generated_tokens for k in kids)
            run(kids, c.env, c.generator, c.tokenizer, c.sampling, c.max_total_tokens, stats=stats)
            expansion_tokens += sum(k.episode.generated_tokens for k in kids) - before
            for kid, ti in zip(kids, owners):
                trees[ti].append(kid)
        leaves: list[Trajectory] = []
        for ti, tree in enumerate(trees):
            q, m = divmod(ti, cfg.trees)
            for leaf in tree:
                leaf.group_id = indices[q] * cfg.trees + m  # the trainer's groups are trees
                leaves.append(leaf)
        metrics = {**stats.metrics(), **c.rewards(leaves)}
        chain_tokens = sum(t.episode.generated_tokens for tree in trees for t in tree[:1])
        metrics["tree/leaves"] = Sum(len(leaves))
        metrics["tree/expanded_depth"] = Mean(sum(expanded_from), len(expanded_from))
        metrics["tree/chain_tokens"] = Sum(chain_tokens)
        metrics["tree/expansion_tokens"] = Sum(expansion_tokens)
        metrics["tree/generated_tokens_per_leaf"] = Mean(chain_tokens + expansion_tokens, len(leaves))
        return self.finish(leaves, metrics)

    def finish(
        self, trajs: list[Trajectory], metrics: dict[str, float]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Leaves are trained as they are: no truncation masking or folding here (`validate` refuses folding)."""
        return trajs, metrics

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """Eq. 9 on every leaf's action tokens (module docstring); the KL as GRPO's (in the loss, or in the
        reward with ``kl_in: reward``)."""
        rewards = batch.rewards
        metrics: dict[str, float] = {}
        if self.cfg.kl_in == "reward" and self.kl_coef > 0:
            kl = (
                self.kl_estimate(batch.extras.need("old_logp"), batch.extras.need("ref_logp"))
                * batch.loss_mask
            )
            rewards = rewards - self.kl_coef * kl.sum(-1)
            metrics["kl/sequence"] = Mean(float(kl.sum()), len(kl))
        adv = tree_advantages(rewards, batch.group_ids, self.cfg.trees, self.cfg.std_normalize, self.cfg.eps)
        batch.extras.advantages = broadcast_to_tokens(adv, batch.loss_mask)
        return metrics
