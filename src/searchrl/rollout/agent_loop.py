"""The per-episode agent loop: every episode advances on its own through the generator's continuous batch.

As soon as an episode's action ends (a stop tag, EOS or its token budget) it waits for the environment;
waiting episodes are stepped together (one batched retrieval) once the batch has decoded ``window`` more
tokens since the first of them arrived, or at once when nothing else is decoding. Each observation is
appended and the episode's next action is queued while the others are still decoding, so no episode waits
for the slowest action of a turn. The outputs are those of the turn loop (`searchrl.rollout.loop.run`):
the same segments, ids and log-probs as sampled, stop rules and statistics; for greedy decoding the same
trajectories (tests/rollout/test_agent_loop.py). One difference: each episode's token budget for an action
is its own remaining room, where the turn loop gives the episodes near their cap a batch of their own under
the smallest room among them.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

from searchrl.core.types import Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.rollout.episode import RolloutStats, finish, ready, step_env
from searchrl.rollout.generator import Generation, SamplingParams

WINDOW = 4  # decode steps an action that has ended may wait for others to share its retrieval batch


def run_episodes(
    trajs: list[Trajectory],
    env: SearchEnv,
    generator: Any,
    tokenizer: Any,
    params: SamplingParams,
    max_total_tokens: int,
    max_steps: int | None = None,
    stats: RolloutStats | None = None,
    window: int = WINDOW,
) -> RolloutStats:
    """`searchrl.rollout.loop.run` for a generator with a ``stream`` (continuous batching)."""
    stats = stats or RolloutStats()
    t0 = time.perf_counter()
    taken = [0] * len(trajs)
    keys: list[Hashable] = [(id(trajs), i) for i in range(len(trajs))]
    index = {k: i for i, k in enumerate(keys)}
    rendered: dict[str, list[int]] = {}
    waiting: list[tuple[int, Generation]] = []
    waited = 0  # decode steps since the first waiting action ended
    try:
        with generator.stream(params) as stream:

            def submit(i: int) -> None:
                t = trajs[i]
                if (max_steps is None or taken[i] < max_steps) and ready(
                    t, env, tokenizer, max_total_tokens, rendered
                ):
                    stream.add(keys[i], t.token_ids, min(params.max_new_tokens, max_total_tokens - len(t)))

            for i in range(len(trajs)):
                submit(i)
            while len(stream) or waiting:
                if len(stream):
                    waiting += [(index[k], g) for k, g in stream.step()]
                    waited += bool(waiting)
                if waiting and (waited > window or not len(stream)):
                    for i in step_env(waiting, trajs, env, tokenizer, stats, taken):
                        if trajs[i].state.done:  # type: ignore[union-attr]
                            generator.release([keys[i]])
                        else:
                            submit(i)
                    waiting, waited = [], 0
    finally:
        generator.release(keys)  # the weights change before the next call
    finish(trajs, stats, t0, env)
    return stats
