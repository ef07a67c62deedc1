"""Collapse guards: monitors on the step metrics that stop a run, or roll it back to its last good
checkpoint with a smaller learning rate, when training degenerates.

The failure peer search-agent projects report most is GRPO collapse: the policy's entropy or its response
length falls to nothing, the KL to the reference explodes, the reward crashes. A guard watches one metric's
mean over a window of steps (``trainer.guards.monitors``), against fixed bounds (``min``, ``max``) or against
its own best (``max_drop``: how far the windowed mean may fall below the highest it reached since the run,
or its last rollback, started; a reward that climbs and then crashes). A monitor with ``unless_reward_above``
is not checked while the training reward's mean over its window is at least that: a policy whose entropy
falls because it succeeds has converged, not collapsed. The metrics are reduced over
processes before the check, so every process trips at the same step. Non-finite losses and gradient norms always trip.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from searchrl.core.errors import SearchRLError
from searchrl.engine.engine import Engine, NonFiniteError

if TYPE_CHECKING:
    from searchrl.algorithms.base import Algorithm
    from searchrl.core.config import GuardConfig, GuardsConfig
    from searchrl.engine.checkpoint import Checkpointer
    from searchrl.engine.metrics import MetricsSink

# monitor names -> the metrics.jsonl keys they watch
MONITORS = {
    "entropy": "train/entropy",
    "kl": "train/kl",
    "length": "rollout/response_tokens",
    "reward": "reward/mean",
    "grad_norm": "train/grad_norm",
    "loss": "train/loss",
    "tool_calls": "rollout/tool_calls_per_episode",  # the tool protocol: a run that stops calling tools
    "tool_errors": "tool/error_rate",  # the tool protocol: tools that fail (a dead server, a broken tool)
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
        # the training reward over each monitor's window (unless_reward_above)
        self.rewards: list[deque[float]] = [deque(maxlen=g.window) for g in self.monitors]
        self.best: list[float] = [-math.inf for _ in self.monitors]  # the highest windowed mean (max_drop)

    def reset(self) -> None:
        """Forget the recent values (after a rollback, the windows refill from the restored step on, and a
        ``max_drop`` monitor's best is measured again from there)."""
        for w in (*self.windows, *self.rewards):
            w.clear()
        self.best = [-math.inf for _ in self.monitors]

    def check(self, step: int, metrics: dict[str, float]) -> Trip | None:
        """The first guard ``metrics`` (of step ``step``, counted from 1) trip, or None."""
        for i, (g, window, rewards) in enumerate(zip(self.monitors, self.windows, self.rewards)):
            key = MONITORS.get(g.metric, g.metric)
            if key not in metrics:  # e.g. the KL of a run without a reference model
                continue
            value = float(metrics[key])
            if not math.isfinite(value):
                return Trip(step, g.metric, key, value, "finite", 1)
            window.append(value)
            if MONITORS["reward"] in metrics:
                rewards.append(float(metrics[MONITORS["reward"]]))
            if step <= g.after or len(window) < g.window:
                continue
            if (
                g.unless_reward_above is not None
                and len(rewards) == g.window
                and sum(rewards) / g.window >= g.unless_reward_above
            ):
                continue  # converged, not collapsed
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


class Rollback:
    """What a trip does (``trainer.guards.on_trip``): stop with a message naming the monitor and the last good
    checkpoint, or restore that checkpoint and go on at a smaller learning rate. The run's trips are kept in
    ``guards.json`` (over resumes too)."""

    def __init__(
        self,
        cfg: GuardsConfig,
        engine: Engine,
        ckpt: Checkpointer,
        algo: Algorithm,
        optimizer: Any,
        scheduler: Any,
        sink: MetricsSink,
        out: Path,
        resume: bool,
    ) -> None:
        self.cfg, self.engine, self.ckpt, self.algo = cfg, engine, ckpt, algo
        self.optimizer, self.scheduler, self.sink, self.out = optimizer, scheduler, sink, out
        log = out / "guards.json"
        self.trips: list[dict[str, Any]] = (
            json.loads(log.read_text())["trips"] if resume and log.exists() else []
        )

    def __call__(self, trip: Trip, guards: Guards) -> int:
        """A guard tripped (or a value went non-finite) at ``trip.step``: record it, then stop with a message
        naming the monitor and the last good checkpoint, or (``on_trip: rollback``) restore that checkpoint,
        scale the learning rate by ``lr_scale`` and return the step to continue from. The last good
        checkpoint is the newest one saved before the window of bad values began: step t's metrics come
        from the policy of checkpoint t − 1, so a window over steps T−W+1…T condemns checkpoints T−W on."""
        g, eng = self.cfg, self.engine
        good = self.ckpt.latest_before(trip.step - trip.window - 1)
        rollbacks = sum(t.get("action") == "rollback" for t in self.trips)
        rollback = g.on_trip == "rollback" and good is not None and rollbacks < g.max_rollbacks
        entry = {**trip.record(), "action": "rollback" if rollback else "stop", "checkpoint": str(good)}
        if rollback:
            assert good is not None
            state = self.ckpt.load(good)
            self.algo.load_state_dict(state.get("algorithm", {}))
            eng.scale_lr(self.optimizer, self.scheduler, g.lr_scale)
            self.ckpt.discard_after(good)
            entry["discarded_metrics"] = self.sink.rewind(int(state["step"]))
            entry["lr_scale"] = g.lr_scale ** (rollbacks + 1)
        self.trips.append(entry)
        if eng.is_main:
            (self.out / "guards.json").write_text(json.dumps({"trips": self.trips}, indent=1) + "\n")
        if rollback:
            guards.reset()
            eng.print(
                f"{trip.describe()}; rolled back to {good} (step {state['step']}), learning rate x{entry['lr_scale']:g}"
            )
            return int(state["step"])
        why = (
            ""
            if g.on_trip == "stop"
            else f" (no checkpoint before step {trip.step - trip.window} to roll back to)"
            if good is None
            else f" (trainer.guards.max_rollbacks = {g.max_rollbacks} reached)"
        )
        where = f"the last good checkpoint is {good or '(none yet)'}"
        if trip.bound == "finite":
            raise NonFiniteError(
                f"training stopped at step {trip.step}: {trip.metric}{why}. Nothing was saved for this step; "
                f"{where}. Lower trainer.lr or check the rewards."
            ) from None
        raise GuardTrip(f"training stopped by a collapse guard at {trip.describe()}{why}; {where}.")
