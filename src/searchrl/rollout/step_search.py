"""Step-level search: from every live episode, sample ``k`` candidate next steps (`loop.expand`), score all
candidates of all episodes in one call, and continue each episode with the candidate ``choose`` picks.

One loop for SLATE's truncated step-level sampling (judge scores, advantage-weighted selection),
RAG-Gym's process-data collection (annotator scores, the best action executed) and PRM-guided best-of-N
inference (PRM scores, the best action executed); each supplies its scorer and its chooser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from searchrl.core.types import Trajectory
from searchrl.rollout.loop import RolloutStats, expand

# score([(prefix, candidate), ...]) -> one score per candidate, in order
Scorer = Callable[[list[tuple[Trajectory, Trajectory]]], Sequence[Any]]
# choose(q, t, prefix, candidates, their scores) -> the index of the candidate episode q continues with
Chooser = Callable[[int, int, Trajectory, list[Trajectory], list[Any]], int]


def step_search(
    prefixes: list[Trajectory],
    k: int,
    score: Scorer,
    choose: Chooser,
    env: Any,
    generator: Any,
    tokenizer: Any,
    params: Any,
    max_total_tokens: int,
    stats: RolloutStats | None = None,
    max_steps: int | None = None,
) -> list[Trajectory]:
    """Advance ``prefixes`` (episode q at index q) step by step until every episode is done, or for
    ``max_steps`` steps (numbered t = 1, 2, …); returns the episodes. An episode with no room left to
    generate (an empty candidate group) is ended."""
    prefixes = list(prefixes)
    t = 0
    while max_steps is None or t < max_steps:
        live = [q for q, p in enumerate(prefixes) if p.state is not None and not p.state.done]
        if not live:
            break
        t += 1
        groups = expand(
            [prefixes[q] for q in live], k, env, generator, tokenizer, params, max_total_tokens, stats
        )
        scores = iter(score([(prefixes[q], c) for q, group in zip(live, groups) for c in group]))
        for q, group in zip(live, groups):
            if not group:
                prefixes[q].episode.done = True
                continue
            prefixes[q] = group[choose(q, t, prefixes[q], group, [next(scores) for _ in group])]
    return prefixes


def best(q: int, t: int, prefix: Trajectory, candidates: list[Trajectory], scores: list[Any]) -> int:
    """The chooser that executes the best-scoring candidate (the first among equals)."""
    return max(range(len(candidates)), key=lambda j: scores[j])
