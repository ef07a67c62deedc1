"""One episode's bookkeeping, shared by the turn loop (`searchrl.rollout.loop`) and the per-episode agent
loop (`searchrl.rollout.agent_loop`): whether an episode acts again, one batched environment step, recording
a sampled action and its observation into the trajectory (ids and log-probs as sampled, docs/design.md §4.1), and
the rollout statistics."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from searchrl.core.aggregate import Mean, Sum
from searchrl.core.types import Segment, Step, Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.envs.tools import TOOL_FAILURES
from searchrl.rollout.generator import Generation

FINISH_REASONS = ("answer", "budget", "eos", "length")  # how an episode can end (Trajectory.finish_reason)


@dataclass
class RolloutStats:
    episodes: int = 0
    tokens_generated: int = 0
    actions: int = 0
    invalid_actions: int = 0
    searches: int = 0
    seconds: float = 0.0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    tool_calls: Counter[str] = field(default_factory=Counter)  # the tool protocol: calls run, per tool
    tool_failures: Counter[str] = field(default_factory=Counter)  # calls that ran and failed, per kind
    folds: int | None = None  # contexts folded into a summary (`envs.context`); None: the env does not fold
    extra: dict[str, float] = field(
        default_factory=dict
    )  # an environment's own metrics (`rollout.agent_program`)

    def metrics(self) -> dict[str, float]:
        """This process's statistics as metrics that combine over processes (`searchrl.core.aggregate`): counts
        summed, rates as numerator / denominator, throughput summed. Every finish reason is reported, with
        0 where no episode had it, so that the rates are over every process's episodes."""
        reasons = dict.fromkeys(FINISH_REASONS, 0) | dict(self.finish_reasons)
        return {
            "rollout/tokens_generated": Sum(self.tokens_generated),
            "rollout/response_tokens": Mean(self.tokens_generated, self.episodes),  # per episode
            "rollout/tokens_per_second": Sum(self.tokens_generated / max(self.seconds, 1e-9)),
            "rollout/searches_per_episode": Mean(self.searches, self.episodes),
            "rollout/invalid_action_rate": Mean(self.invalid_actions, self.actions),
            **{f"rollout/finish_{k}": Mean(v, self.episodes) for k, v in sorted(reasons.items())},
            **self._tool_metrics(),
            **({} if self.folds is None else {"rollout/context_folds": Mean(self.folds, self.episodes)}),
            **self.extra,
        }

    def _tool_metrics(self) -> dict[str, float]:
        """Tool calls per episode, in all and per tool (the tool protocol; every tool of the environment is
        listed, with 0 where it was not called, so that every process reports the same keys)."""
        if not self.tool_calls:
            return {}
        per_tool = {
            f"rollout/tool_calls/{k}": Mean(v, self.episodes) for k, v in sorted(self.tool_calls.items())
        }
        runs = sum(self.tool_calls.values())
        return {
            "rollout/tool_calls_per_episode": Mean(runs, self.episodes),
            **per_tool,
            "tool/error_rate": Mean(sum(self.tool_failures.values()), runs),
            **{f"tool/{name}_rate": Mean(self.tool_failures[k], runs) for k, name in TOOL_FAILURES.items()},
        }


# Trajectory.info key: per step, the sampling distribution's entropy at the step's first tokens (when the sampling
# parameters ask for it, `SamplingParams.entropy_tokens`), aligned with Trajectory.steps
STEP_ENTROPY = "step_entropy"


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def step_env(
    actions: list[tuple[int, Generation]],
    trajs: list[Trajectory],
    env: SearchEnv,
    tokenizer: Any,
    stats: RolloutStats,
    taken: list[int],
) -> list[int]:
    """One environment step (one batched retrieval) for these (episode index, action) pairs, in episode
    order, each recorded into its trajectory; the indices stepped."""
    actions = sorted(actions, key=lambda x: x[0])
    gens = [g for _, g in actions]
    texts = [tokenizer.decode(g.token_ids) for g in gens]  # decoded to parse, never re-tokenized
    # the tool protocol's action is a whole assistant turn, which the model ends with its EOS (end of turn)
    turn_end = getattr(env, "eos_ends_turn", False)
    ended = [not g.token_ids or g.finish == "length" or (g.finish == "eos" and not turn_end) for g in gens]
    stopped = [not e for e in ended]  # at a closing tag (or the end of a turn), maybe inside the last token
    results = env.step_batch([trajs[i].state for i, _ in actions], texts, ended, stopped)  # type: ignore[misc]
    for (i, g), (obs, done, info) in zip(actions, results):
        taken[i] += 1
        record(trajs[i], g, obs, done, info, env, tokenizer, stats)
    return [i for i, _ in actions]


def ready(
    t: Trajectory, env: SearchEnv, tokenizer: Any, max_total_tokens: int, rendered: dict[str, list[int]]
) -> bool:
    """Whether episode ``t`` takes another action; prepares its context for it. A re-rendered design
    (RAG-Gym ReSearch) restarts from the rendered state; with ``env.context`` a full context is folded into a
    summary (`envs.context`); an episode out of room ends with "length"."""
    if t.state is None or t.state.done:
        return False
    if not env.append_only and t.state.actions:
        text = env.render(t.state)
        if text not in rendered:  # k candidates share one rendered state: tokenized once
            rendered[text] = encode(tokenizer, text)
        t.segments, t.steps = [Segment("prompt", rendered[text])], []
    folder = getattr(env, "context", None)  # long horizons (`envs.context`): a full context is folded
    if folder is not None and folder.due(t):
        folder.fold(t, env, tokenizer)
    if len(t) >= max_total_tokens - 1:
        t.state.done, t.finish_reason = True, "length"
        return False
    return True


def record(
    t: Trajectory,
    g: Generation,
    obs: str | None,
    done: bool,
    info: Any,
    env: SearchEnv,
    tokenizer: Any,
    stats: RolloutStats,
) -> None:
    """Append a sampled action (ids and log-probs as sampled) and its observation to ``t``; count it."""
    if g.token_ids:  # an empty generation (never from our backends) has no tokens to train on
        t.segments.append(Segment("action", g.token_ids, g.logprobs, g.versions))
        t.steps.append(Step(segment=len(t.segments) - 1, last_token=len(t) - 1, info=info))
        if g.entropy is not None:  # asked for (`SamplingParams.entropy_tokens`): one list per step
            t.info.setdefault(STEP_ENTROPY, []).append(list(g.entropy))
    if obs and env.append_only:
        t.segments.append(Segment("observation", encode(tokenizer, obs)))
    stats.tokens_generated += len(g.token_ids)
    t.state.generated_tokens += len(g.token_ids)  # type: ignore[union-attr]
    stats.actions += 1
    stats.invalid_actions += not info.valid
    stats.searches += info.kind == "search" and info.valid
    for name in getattr(env, "tool_names", ()):
        stats.tool_calls[name] += info.calls.count(name)
    stats.tool_failures.update(getattr(info, "failures", ()))
    if done:
        t.finish_reason = "length" if g.finish == "length" else t.state.finish_reason  # type: ignore[union-attr]


def finish(trajs: Sequence[Trajectory], stats: RolloutStats, t0: float, env: Any = None) -> None:
    """Count the finished episodes, their folded contexts (``env`` folds, `envs.context`) and the time since
    ``t0``; settle the tool objects of episodes that ran out of room (`envs.python_tools.settle`: those that
    answered or spent their budget were settled then)."""
    from searchrl.envs.context import FOLDS
    from searchrl.envs.python_tools import settle

    if getattr(env, "context", None) is not None:
        stats.folds = (stats.folds or 0) + sum(
            len(t.info.get(FOLDS, ())) for t in trajs if t.state is not None and t.state.done
        )
    for t in trajs:
        if t.state is not None and t.state.tool_objects:
            settle(t.state)
        if t.state is not None and t.state.done:
            stats.episodes += 1
            stats.searches += t.state.prefetched is not None  # the rag design's retrieval with the question
            stats.finish_reasons[t.finish_reason or "unknown"] += 1
    stats.seconds += time.perf_counter() - t0
