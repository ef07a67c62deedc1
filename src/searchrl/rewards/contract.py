"""The reward registry and the value every reward returns.

A reward is a function ``f(traj, *, <fields>, <args>) -> RewardOutput | float``. It gets the finished
episode (``traj.state`` holds every action, observation, parsed step and retrieved document) and, by
naming them as keyword-only parameters, any of:

- ``answers``, ``hops``, ``metadata``, ``example``: the example's fields (``hops`` is its decomposition:
  sub-questions, sub-answers, gold document ids, gold search keys);
- ``docs``: the retrieval corpus as a mapping ``doc id -> Doc`` (built once, on first use).

A batched reward (a class) with a ``resources`` attribute gets the same resources as zero-argument builders
by name (``docs``, and ``retriever``: the run's retriever).

Its other keyword-only parameters are its ``args``, set in the experiment file and checked against the
signature. A reward may also be a class (a batched reward, e.g. the LLM answer judge): built once with its
``args``, it is called with the list of a step's trajectories and returns one score or output each. Outcome rewards return a score; process rewards also return one score per step, which the
masker places at that step's last action token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from searchrl.core.registry import Registry

REWARDS: Registry[Callable[..., Any]] = Registry("reward")


@dataclass(frozen=True)
class RewardOutput:
    score: float  # outcome reward for the whole trajectory
    step_scores: tuple[float, ...] = ()  # process reward per step (empty for outcome rewards)
    metrics: dict[str, float] = field(default_factory=dict)  # anything worth logging


def register_reward(name: str, kind: str = "outcome") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register_reward("retrieval_hit", kind="process")``. The function is then known by
    that name, and by its dotted path ``package.module:function`` too (with the same kind)."""
    if kind not in ("outcome", "process"):
        raise ValueError(f"reward kind must be 'outcome' or 'process', got {kind!r}")
    add = REWARDS.register(name, kind=kind)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.reward_kind = kind  # type: ignore[attr-defined]
        return add(fn)

    return deco


def reward_kind(name: str) -> str:
    """ "outcome" or "process", for registered names and dotted paths alike."""
    kind = REWARDS.meta(name).get("kind")
    return str(kind or getattr(REWARDS.get(name), "reward_kind", "outcome"))


REWARDS.add_lazy("em", "searchrl.rewards.outcome:em_reward", kind="outcome")
REWARDS.add_lazy("f1", "searchrl.rewards.outcome:f1_reward", kind="outcome")
REWARDS.add_lazy("cover_em", "searchrl.rewards.outcome:cover_em_reward", kind="outcome")
REWARDS.add_lazy("judge", "searchrl.rewards.answer_judge:JudgeReward", kind="outcome")
REWARDS.add_lazy("gen_acc", "searchrl.rewards.answer_judge:GenAccReward", kind="outcome")
REWARDS.add_lazy("gbr", "searchrl.rewards.gbr:GainBeyondRAG", kind="outcome")
REWARDS.add_lazy("research", "searchrl.rewards.research:research_reward", kind="outcome")
REWARDS.add_lazy("autorefine", "searchrl.rewards.autorefine:autorefine_reward", kind="outcome")
REWARDS.add_lazy("action_penalty", "searchrl.rewards.outcome:action_penalty_reward", kind="outcome")
REWARDS.add_lazy("parallel_search", "searchrl.rewards.outcome:parallel_search_reward", kind="outcome")
REWARDS.add_lazy("overlong", "searchrl.rewards.outcome:overlong_reward", kind="outcome")
REWARDS.add_lazy("tool_env", "searchrl.rewards.outcome:tool_env_reward", kind="outcome")
REWARDS.add_lazy("search_r1_format", "searchrl.rewards.outcome:search_r1_format_reward", kind="outcome")
REWARDS.add_lazy("stepsearch", "searchrl.rewards.stepsearch:stepsearch_reward", kind="process")
REWARDS.add_lazy("prm", "searchrl.rewards.prm_scorer:prm_reward", kind="process")

# What a reward may ask for by name besides its args: the example's fields, and shared resources.
PROVIDED = ("answers", "hops", "metadata", "example", "docs")
