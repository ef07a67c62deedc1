"""The reward registry and the value every reward returns.

A reward is a function ``f(traj, *, answers, hops, metadata, **args) -> RewardOutput | float``. It gets
the finished episode and every field of its example; ``args`` come from the experiment file. Outcome
rewards return a score; process rewards also return per-step scores, placed at each step's last action
token by the masker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from searchrl.registry import Registry

REWARDS: Registry[Callable[..., Any]] = Registry("reward")


@dataclass(frozen=True)
class RewardOutput:
    score: float  # outcome reward for the whole trajectory
    step_scores: tuple[float, ...] = ()  # process reward per step (empty for outcome rewards)
    metrics: dict[str, float] = field(default_factory=dict)  # anything worth logging


def register_reward(name: str, kind: str = "outcome") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register_reward("retrieval_hit", kind="process")``."""
    if kind not in ("outcome", "process"):
        raise ValueError(f"reward kind must be 'outcome' or 'process', got {kind!r}")
    return REWARDS.register(name, kind=kind)


REWARDS.add_lazy("em", "searchrl.rewards.outcome:em_reward", kind="outcome")
REWARDS.add_lazy("f1", "searchrl.rewards.outcome:f1_reward", kind="outcome")
REWARDS.add_lazy("research", "searchrl.rewards.research:research_reward", kind="outcome")
