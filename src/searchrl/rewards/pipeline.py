"""Weighted combination of registered rewards, applied to finished trajectories."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from searchrl.config import RewardSpec
from searchrl.rewards.registry import REWARDS, RewardOutput
from searchrl.types import Trajectory


def call_reward(fn: Any, traj: Trajectory, args: dict[str, Any]) -> RewardOutput:
    ex = traj.example
    out = fn(traj, answers=ex.answers, hops=ex.hops, metadata=ex.metadata, example=ex, **args)
    return out if isinstance(out, RewardOutput) else RewardOutput(score=float(out))


class RewardPipeline:
    """``traj.reward = Σ w_i · score_i``; ``traj.step_rewards = Σ w_i · step_scores_i`` (one per step)."""

    def __init__(self, specs: Sequence[RewardSpec]) -> None:
        if not specs:
            raise ValueError("no rewards configured: add e.g. `rewards: [{name: f1}]` to the experiment")
        self.specs = list(specs)
        self.fns = [REWARDS.get(s.name) for s in self.specs]

    def __call__(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        for t in trajs:
            total, steps = 0.0, [0.0] * len(t.steps)
            for spec, fn in zip(self.specs, self.fns):
                out = call_reward(fn, t, spec.args)
                total += spec.weight * out.score
                if out.step_scores:
                    if len(out.step_scores) != len(t.steps):
                        raise ValueError(f"reward '{spec.name}' gave {len(out.step_scores)} step scores for "
                                         f"{len(t.steps)} steps")  # fmt: skip
                    steps = [a + spec.weight * b for a, b in zip(steps, out.step_scores)]
                sums[f"reward/{spec.name}"] += out.score
                for k, v in out.metrics.items():
                    sums[f"reward/{spec.name}/{k}"] += v
            t.reward, t.step_rewards = total, steps
        n = max(len(trajs), 1)
        return {k: v / n for k, v in sums.items()}
