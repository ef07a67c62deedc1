"""Weighted combination of registered rewards, applied to finished trajectories."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from searchrl.core.aggregate import Mean
from searchrl.core.config import RewardSpec
from searchrl.core.errors import DataError
from searchrl.core.types import Trajectory
from searchrl.rewards.contract import PROVIDED, REWARDS, RewardOutput, reward_kind


def wanted(fn: Any) -> tuple[str, ...]:
    """Which of the provided fields (`registry.PROVIDED`) ``fn`` names (all of them if it takes ``**kw``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return PROVIDED
    return tuple(n for n in PROVIDED if n in params)


def call_reward(
    fn: Any, traj: Trajectory, args: dict[str, Any], resources: Mapping[str, Callable[[], Any]] | None = None
) -> RewardOutput:
    """Call a reward with the fields it names, its ``args`` and (lazily built) resources such as ``docs``."""
    ex = traj.example
    fields: dict[str, Any] = {"answers": ex.answers, "hops": ex.hops, "metadata": ex.metadata, "example": ex}
    kwargs = {}
    for name in wanted(fn):
        if name in fields:
            kwargs[name] = fields[name]
        elif resources is not None and name in resources:
            kwargs[name] = resources[name]()
    return _as_output(fn(traj, **kwargs, **args))


def check_calling_convention(fn: Any, args: Mapping[str, Any]) -> None:
    """Raise TypeError unless ``fn(traj, **provided_fields, **args)`` binds, or, for a batched reward (a
    class), ``cls(**args)`` (checked at `validate` time)."""
    if inspect.isclass(fn):
        inspect.signature(fn).bind(**args)
        return
    inspect.signature(fn).bind(None, **{n: None for n in wanted(fn)}, **args)


def is_batched(fn: Any) -> bool:
    """A batched reward is a class: built once with its ``args``, then called with a list of trajectories,
    returning one score or `RewardOutput` each (an LLM judge sends them as one batch)."""
    return inspect.isclass(fn)


def _as_output(out: Any) -> RewardOutput:
    if isinstance(out, RewardOutput):
        return out
    if isinstance(out, bool) or not isinstance(out, int | float):
        raise TypeError(f"returned {out!r}; a reward returns a number or a RewardOutput")
    return RewardOutput(score=float(out))


class RewardPipeline:
    """``traj.reward = Σ w_i · score_i``; ``traj.step_rewards = Σ w_i · step_scores_i`` (one per step).

    ``resources`` maps a name a reward may ask for (``docs``) to a zero-argument function building it;
    each is built once, on first use. Batched rewards (`is_batched`) are built once, on first use, and
    scored over the whole list first."""

    def __init__(
        self, specs: Sequence[RewardSpec], resources: Mapping[str, Callable[[], Any]] | None = None
    ) -> None:
        if not specs:
            raise DataError("no rewards configured: add e.g. `rewards: [{name: f1}]` to the experiment")
        self.specs = list(specs)
        self.fns = [REWARDS.get(s.name) for s in self.specs]
        self._batched: dict[int, Any] = {}
        self._built: dict[str, Any] = {}
        self.resources = {k: self._once(k, f) for k, f in (resources or {}).items()}

    def _once(self, name: str, build: Callable[[], Any]) -> Callable[[], Any]:
        def get() -> Any:
            if name not in self._built:
                self._built[name] = build()
            return self._built[name]

        return get

    @property
    def has_process_rewards(self) -> bool:
        return any(reward_kind(s.name) == "process" for s in self.specs)

    def _score_batched(self, trajs: Sequence[Trajectory]) -> dict[int, list[RewardOutput]]:
        """The batched rewards' outputs, by spec index, one per trajectory."""
        out: dict[int, list[RewardOutput]] = {}
        for i, (spec, fn) in enumerate(zip(self.specs, self.fns)):
            if not is_batched(fn):
                continue
            try:
                if i not in self._batched:
                    self._batched[i] = fn(**spec.args)
                    if hasattr(self._batched[i], "resources"):  # it reads shared resources (the retriever)
                        self._batched[i].resources = self.resources
                scores = [_as_output(x) for x in self._batched[i](list(trajs))]
            except Exception as exc:
                raise DataError(f"reward '{spec.name}' failed: {type(exc).__name__}: {exc}") from exc
            if len(scores) != len(trajs):
                raise DataError(
                    f"reward '{spec.name}' gave {len(scores)} scores for {len(trajs)} trajectories"
                )
            out[i] = scores
        return out

    def __call__(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        batched = self._score_batched(trajs) if trajs else {}
        for j, t in enumerate(trajs):
            total, steps = 0.0, [0.0] * len(t.steps)
            for i, (spec, fn) in enumerate(zip(self.specs, self.fns)):
                if i in batched:
                    out = batched[i][j]
                else:
                    try:
                        out = call_reward(fn, t, spec.args, self.resources)
                    except Exception as exc:
                        raise DataError(
                            f"reward '{spec.name}' failed on question {t.example.id}: "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                total += spec.weight * out.score
                if out.step_scores:
                    if len(out.step_scores) != len(t.steps):
                        raise DataError(
                            f"reward '{spec.name}' gave {len(out.step_scores)} step scores for "
                            f"{len(t.steps)} steps"
                        )
                    steps = [a + spec.weight * b for a, b in zip(steps, out.step_scores)]
                sums[f"reward/{spec.name}"] += out.score
                for k, v in out.metrics.items():
                    sums[f"reward/{spec.name}/{k}"] += v
            t.reward, t.step_rewards = total, steps
        return {k: Mean(v, len(trajs)) for k, v in sums.items()}  # means over every process's trajectories


def episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``train/em``: the exact match of the episodes these rows end (a folded or split episode counted once, at
    its last row; rows of no episode, the trainer's padding, not at all)."""
    from searchrl.core.answers import exact_match
    from searchrl.envs.context import last_rows

    episodes = [t for t, end in zip(trajs, last_rows(trajs)) if t.state is not None and end]
    if not episodes:
        return {}
    em = sum(exact_match(t.answer or "", t.example.answers) for t in episodes)
    return {"train/em": Mean(em, len(episodes))}
