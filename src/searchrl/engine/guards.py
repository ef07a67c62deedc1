"""Collapse guards: monitors on the step metrics that stop a run, or roll it back to its last good
checkpoint with a smaller learning rate, when training degenerates.

The failure peer search-agent projects report most is GRPO collapse: the policy's entropy or its response
length falls to nothing, the KL to the reference explodes, the reward crashes. A guard watches one metric's
mean over a window of steps (``trainer.guards.monitors``), against fixed bounds (``min``, ``max``) or against
its own best (``max_drop``: how far the windowed mean may fall below the highest it reached since the run,
or its last rollback, started; a reward that climbs and then crashes); the metrics are reduced over
processes before the check, so every process trips at the same step. Non-finite losses and gradient norms always trip.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from searchrl.core.errors import SearchRLError

if TYPE_CHECKING:
    from searchrl.core.config import GuardConfig

# monitor names -> the metrics.jsonl keys they watch
MONITORS = {
    "entropy": "train/entropy",
    "kl": "train/kl",
    "length": "rollout/response_tokens",
    "reward": "reward/mean",
    "grad_norm": "train/grad_norm",
    "loss": "train/loss",
    "tool_calls": "rollout/tool_calls_per_episode",  # the tool protocol: a run that stops calling tools
}


class GuardTrip(SearchRLError):
    """Training stopped by a collapse guard (or by a non-finite value)."""


@dataclass(frozen=True)
class Trip:
    step: int  # the step (counted from 1) whose metrics tripped the guard
    monitor: str  # the monitor's name as configured, or "non-finite"
    metric: str  # the metrics key it watches
    value: float  # the windowed mean (or the non-finite value)
    bound: str  # "min 0.05", "max 2", "finite"
    window: int  # steps the value is a mean over (0: the step failed before its metrics existed)

    def describe(self) -> str:
        if self.bound == "finite":
            return f"step {self.step}: {self.metric} is {self.value} (non-finite)"
        over = f"mean over the last {self.window} steps" if self.window > 1 else "value"
        return f"step {self.step}: guard '{self.monitor}' ({self.metric}) {over} is {self.value:.4g}, {self.bound}"

    def record(self) -> dict[str, Any]:
        return asdict(self)


class Guards:
    """The configured monitors and their windows of recent values."""

    def __init__(self, monitors: tuple[GuardConfig, ...] | list[GuardConfig]) -> None:
        self.monitors = list(monitors)
        self.windows: list[deque[float]] = [deque(maxlen=g.window) for g in self.monitors]
        self.best: list[float] = [-math.inf for _ in self.monitors]  # the highest windowed mean (max_drop)

    def reset(self) -> None:
        """Forget the recent values (after a rollback, the windows refill from the restored step on, and a
        ``max_drop`` monitor's best is measured again from there)."""
        for w in self.windows:
            w.clear()
        self.best = [-math.inf for _ in self.monitors]

    def check(self, step: int, metrics: dict[str, float]) -> Trip | None:
        """The first guard ``metrics`` (of step ``step``, counted from 1) trip, or None."""
        for i, (g, window) in enumerate(zip(self.monitors, self.windows)):
            key = MONITORS.get(g.metric, g.metric)
            if key not in metrics:  # e.g. the KL of a run without a reference model
                continue
            value = float(metrics[key])
            if not math.isfinite(value):
                return Trip(step, g.metric, key, value, "finite", 1)
            window.append(value)
            if step <= g.after or len(window) < g.window:
                continue
            mean = sum(window) / len(window)
            if g.min is not None and mean < g.min:
                return Trip(step, g.metric, key, mean, f"below min {g.min:g}", g.window)
            if g.max is not None and mean > g.max:
                return Trip(step, g.metric, key, mean, f"above max {g.max:g}", g.window)
            self.best[i] = max(self.best[i], mean)
            if g.max_drop is not None and self.best[i] - mean > g.max_drop:
                bound = (
                    f"{self.best[i] - mean:.4g} below its best {self.best[i]:.4g} (max_drop {g.max_drop:g})"
                )
                return Trip(step, g.metric, key, mean, bound, g.window)
        return None
