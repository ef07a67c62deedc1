"""The multi-turn rollout loop shared by every online algorithm.

Each round generates the next action for every live episode in one batch, steps the `SearchEnv` for all
of them at once (one batched retrieval), tokenizes each observation once and appends it. Model output is
decoded only to be parsed; its token ids are kept as sampled (docs/design.md §4.1). Episodes can start fresh (G
samples per question, GRPO/PPO) or from recorded prefixes, generating k candidates of just the next step
(SLATE, RAG-Gym). For a re-rendered agent design (``research``, `SearchEnv.append_only` False) each turn
starts from the rendered state instead; its trajectory then holds only the latest (state, action).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from searchrl.core.records import Example
from searchrl.core.types import Segment, Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.rollout.episode import (  # noqa: F401  (imported from here too)
    FINISH_REASONS,
    RolloutStats,
    encode,
    finish,
    ready,
    record,
    step_env,
)
from searchrl.rollout.generator import Generator, SamplingParams


def check_prompt_room(
    env: SearchEnv, tokenizer: Any, examples: Sequence[Example], max_total_tokens: int
) -> None:
    """Refuse a ``rollout.max_total_tokens`` that the longest prompt of ``examples`` already fills: every
    episode of that question would end before its first action."""
    if not examples:
        return
    states = [env.reset(ex) for ex in examples]
    prompts = [s.prompt for s in states]
    for s in states:  # measured, not played: their tool objects released
        env.discard(s)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    i = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[i] >= max_total_tokens:
        from searchrl.core.errors import ConfigError

        raise ConfigError(
            f"leaves no room to act: the longest prompt the template renders is {lengths[i]} tokens "
            f"(question {examples[i].id!r}; {sum(n >= max_total_tokens for n in lengths)} of {len(lengths)} "
            "prompts are as long), and an episode's prompt, actions and observations share this budget",
            key="rollout.max_total_tokens",
            value=max_total_tokens,
            hint=f"raise it well above {lengths[i]} (prompt + turns x (action + documents))",
        )


def start_trajectories(
    env: SearchEnv, tokenizer: Any, examples: Sequence[Example], group_size: int = 1, first_group: int = 0
) -> list[Trajectory]:
    """``group_size`` fresh episodes per example; episodes of one example share a group id (and their
    prompt's ids, tokenized once, unless a tool object's ``reset`` gave an episode a prompt of its own)."""
    out = []
    for gi, ex in enumerate(examples):
        prompt, prompt_ids = None, []
        for _ in range(group_size):
            state = env.reset(ex)
            if state.prompt != prompt:
                prompt, prompt_ids = state.prompt, encode(tokenizer, state.prompt)
            out.append(
                Trajectory(ex, [Segment("prompt", list(prompt_ids))], state=state, group_id=first_group + gi)
            )
    return out


def branch(prefixes: Sequence[Trajectory], k: int) -> list[Trajectory]:
    """``k`` copies of each unfinished prefix (same group id as their prefix's index), ready to continue."""
    out = []
    for gi, p in enumerate(prefixes):
        if p.state is None or p.state.done:
            raise ValueError(f"prefix {gi} ({p.example.id}) has no live episode to continue")
        for _ in range(k):
            t = copy.copy(p)
            t.segments, t.steps = list(p.segments), list(p.steps)
            t.step_rewards, t.info = list(p.step_rewards), dict(p.info)
            t.state = copy.copy(p.state)
            for name in ("actions", "observations", "infos", "retrieved"):
                setattr(t.state, name, list(getattr(p.state, name)))
            if p.state.tool_objects:  # each branch plays on its own copy of the episode's tool objects
                from searchrl.envs.python_tools import fork

                t.state.tool_objects = fork(p.state.tool_objects)
            t.group_id = gi
            out.append(t)
    return out


def run(
    trajs: list[Trajectory],
    env: SearchEnv,
    generator: Generator,
    tokenizer: Any,
    params: SamplingParams,
    max_total_tokens: int,
    max_steps: int | None = None,
    stats: RolloutStats | None = None,
) -> RolloutStats:
    """Advance every episode until it answers, hits the budget or length, or takes ``max_steps`` actions.

    With a continuous generator (``generator.continuous``, a ``stream`` method) each episode advances on its
    own (`searchrl.rollout.agent_loop`); otherwise in turns: one batched generation for every live episode,
    then one environment step for all of them."""
    if getattr(generator, "continuous", False) and hasattr(generator, "stream"):
        from searchrl.rollout.agent_loop import run_episodes

        return run_episodes(trajs, env, generator, tokenizer, params, max_total_tokens, max_steps, stats)
    stats = stats or RolloutStats()
    t0 = time.perf_counter()
    taken = [0] * len(trajs)
    keys = [(id(trajs), i) for i in range(len(trajs))]  # KV-cache keys, valid for this call only
    rendered: dict[str, list[int]] = {}  # re-rendered states tokenized once (k candidates share one)
    try:
        while True:
            live = [
                i
                for i, t in enumerate(trajs)
                if (
                    max_steps is None or taken[i] < max_steps
                )  # first: a finished candidate keeps its segments
                and ready(t, env, tokenizer, max_total_tokens, rendered)
            ]
            if not live:
                break
            actions = []
            for rows, budget in _by_room(live, trajs, params.max_new_tokens, max_total_tokens):
                gens = generator.generate(
                    [trajs[i].token_ids for i in rows], _with_max(params, budget), [keys[i] for i in rows]
                )
                actions += list(zip(rows, gens))
            for i in step_env(actions, trajs, env, tokenizer, stats, taken):
                if trajs[i].state.done:  # type: ignore[union-attr]
                    generator.release([keys[i]])
    finally:
        generator.release(keys)  # the weights change before the next call
    finish(trajs, stats, t0, env)
    return stats


def _by_room(
    live: list[int], trajs: list[Trajectory], max_new: int, max_total: int
) -> list[tuple[list[int], int]]:
    """The turn's generation calls: the episodes with room for a whole action in one batch of ``max_new``
    tokens, and those nearer their ``max_total`` cap in a second batch, under the least room among them (one
    batch shares one token budget: in one call, an episode near its cap would cut every episode's action)."""
    room = {i: max_total - len(trajs[i]) for i in live}
    full = [i for i in live if room[i] >= max_new]
    short = [i for i in live if room[i] < max_new]
    calls = [(full, max_new)] if full else []
    return calls + ([(short, min(room[i] for i in short))] if short else [])


def _with_max(params: SamplingParams, budget: int) -> SamplingParams:
    return dataclasses.replace(params, max_new_tokens=max(1, budget))


def rollout(
    examples: Sequence[Example],
    env: SearchEnv,
    generator: Generator,
    tokenizer: Any,
    params: SamplingParams,
    group_size: int,
    max_total_tokens: int,
) -> tuple[list[Trajectory], RolloutStats]:
    """G full episodes per example; an environment that plays its episodes itself (an agent program,
    `rollout.agent_program`) plays them."""
    if hasattr(env, "play"):
        return env.play(examples, generator, tokenizer, params, group_size, max_total_tokens)  # type: ignore[no-any-return]
    trajs = start_trajectories(env, tokenizer, examples, group_size)
    stats = run(trajs, env, generator, tokenizer, params, max_total_tokens)
    return trajs, stats


def expand(
    prefixes: Sequence[Trajectory],
    k: int,
    env: SearchEnv,
    generator: Generator,
    tokenizer: Any,
    params: SamplingParams,
    max_total_tokens: int,
    stats: RolloutStats | None = None,
) -> list[list[Trajectory]]:
    """``k`` candidate next steps from each live prefix (`branch` + one step of `run`), run through the
    environment. Group g holds prefix g's candidates that generated an action; it is empty when the
    prefix had no room left (length budget). A candidate's last step is its new action, its segments
    before that step the state it was generated from."""
    kids = branch(prefixes, k)
    run(kids, env, generator, tokenizer, params, max_total_tokens, max_steps=1, stats=stats)
    return [
        [c for c in kids[g * k : (g + 1) * k] if c.episode.generated_tokens > p.episode.generated_tokens]
        for g, p in enumerate(prefixes)
    ]
