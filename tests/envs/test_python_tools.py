"""The tools users bring (`searchrl.envs.python_tools`): ``async def`` functions awaited, stateful classes with
one instance per episode (reset, release, the reward they own), per-tool settings (description and schema
override, timeout, concurrency limit), and the shipped example."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from searchrl.core.config import ToolSpec
from searchrl.core.errors import ConfigError
from searchrl.core.records import Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import call_all, class_tools, function_tool
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tool_specs import build_tools

from .test_tools import DOCS, CountingRetriever, call

REPO = Path(__file__).resolve().parents[2]
EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))


async def lookup(city: str) -> str:
    """Look a city up, asynchronously.

    Args:
        city: the city's name
    """
    await asyncio.sleep(0.01)
    return f"{city} is in France"


def test_an_async_function_is_awaited(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools")
    env.set_tools([function_tool(lookup)])
    state = env.reset(EX)
    obs, _, info = env.step(
        state, f"{call('lookup', city='Lyon')}{call('lookup', city='Nice')}<|im_end|>", stopped=True
    )
    assert info.valid and "Lyon is in France" in obs and "Nice is in France" in obs and "coroutine" not in obs


def test_calls_run_concurrently_within_the_limit_and_time_out():
    active, peak = [0], [0]
    lock = threading.Lock()

    def work(x: int) -> str:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2 if x else 2.0)
        with lock:
            active[0] -= 1
        return str(x)

    t = time.perf_counter()
    out = call_all([(work, {"x": i}) for i in (1, 2, 3, 4, 0)], timeout=0.5, max_concurrency=2)
    took = time.perf_counter() - t
    assert [r.text for r in out[:4]] == ["1", "2", "3", "4"] and peak[0] <= 2
    assert out[4].error == "tool_timeout" and "0.5 s" in out[4].text
    assert took < 1.5  # the slow call was not waited for


class Counter:
    """A counter per episode."""

    made: ClassVar[list[Counter]] = []

    def __init__(self, start: int = 0) -> None:
        self.n, self.released, self.question = start, False, None
        Counter.made.append(self)

    def reset(self, example) -> None:
        self.question = example.question

    def add(self, k: int) -> str:
        """Add to the count.

        Args:
            k: how much
        """
        self.n += k
        return f"count {self.n}"

    def reward(self, answer: str | None) -> float:
        return float(self.n)

    def release(self) -> None:
        self.released = True


def test_a_class_keeps_state_per_episode_and_owns_a_reward(qwen_tok):
    from searchrl.rewards.outcome import tool_env_reward

    Counter.made.clear()
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools", max_turns=4)
    env.set_tools(class_tools(Counter, "tests:Counter", {"start": 10}))
    assert list(env.tools) == ["add"] and env.tools["add"].parameters["required"] == ["k"]
    a, b = env.reset(EX), env.reset(EX)
    [(oa, _, _), (ob, _, _)] = env.step_batch(
        [a, b], [f"{call('add', k=1)}<|im_end|>", f"{call('add', k=5)}<|im_end|>"]
    )
    assert "count 11" in oa and "count 15" in ob  # one instance each
    [(oa, _, _)] = env.step_batch([a], [f"{call('add', k=2)}<|im_end|>"])
    assert "count 13" in oa and len(Counter.made) == 2 and Counter.made[0].question == EX.question
    [(_, done, _)] = env.step_batch([a], ["Ann Lee<|im_end|>"])
    assert done and Counter.made[0].released and a.tool_objects == {} and a.tool_reward == 13.0
    assert tool_env_reward(type("T", (), {"state": a})()).score == 13.0
    assert not Counter.made[1].released  # the other episode goes on


def test_specs_take_per_tool_settings(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools")
    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    specs = [
        ToolSpec("search", {"description": "Find documents.", "parameters": schema}),
        ToolSpec("tests.envs.test_python_tools:lookup", {"timeout": 5, "max_concurrency": 2}),
        ToolSpec("tests.envs.test_python_tools:Counter", {"kwargs": {"start": 3}}),
    ]
    tools = {t.name: t for t in build_tools(specs, env, {})}
    assert tools["search"].description == "Find documents." and tools["search"].parameters == schema
    assert set(tools) == {"search", "lookup", "add"}
    with pytest.raises(ConfigError, match="unknown tool argument"):
        build_tools([ToolSpec("search", {"timeout": 3})], env, {})
    with pytest.raises(ConfigError, match="kwargs"):
        build_tools([ToolSpec("tests.envs.test_python_tools:lookup", {"kwargs": {}})], env, {})


def test_the_stateful_example_runs_an_episode(qwen_tok, monkeypatch):
    """The shipped example: search, keep, read the shortlist back (async), answer; the bonus it owns."""
    monkeypatch.syspath_prepend(str(REPO / "examples" / "stateful_tools"))
    from my_tools import Library

    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools", max_turns=5)
    env.set_tools(class_tools(Library, "my_tools:Library", {"bonus": 0.5}, retriever=env.retriever))
    state = env.reset(EX)
    [(obs, _, _)] = env.step_batch([state], [f"{call('search', query='Zelka directed')}<|im_end|>"])
    assert "[d3] Zelka" in obs
    [(obs, _, _)] = env.step_batch([state], [f"{call('keep', doc_id='d3')}{call('shortlist')}<|im_end|>"])
    assert "Kept d3" in obs and "Ann Lee" in obs
    [(_, done, _)] = env.step_batch([state], ["Ann Lee<|im_end|>"])
    assert done and state.tool_reward == 0.5 and DOCS


def test_the_stateful_example_validates(monkeypatch):
    from searchrl.app.experiment import check_arguments, load_experiment

    monkeypatch.syspath_prepend(str(REPO / "examples" / "stateful_tools"))
    path = REPO / "examples" / "stateful_tools" / "experiment.yaml"
    check_arguments(load_experiment(path), str(path))
