"""The tools users bring, as TRL and verl take them: Python functions (sync or ``async def``), and stateful
environments whose public methods are the tools.

- `function_tool`: one function, its schema read from its type hints and Google-style docstring
  (transformers' ``get_json_schema``, as TRL's ``tools=[...]``). ``async def`` functions are awaited, the
  calls of one environment step concurrently.
- `class_tools`: a class, one instance per episode (TRL's ``environment_factory``; verl's per-trajectory
  create / execute / release): its public methods are the tools, ``reset(example)`` (if it has one) runs when
  the episode's first call creates the instance, ``release()`` (if any) when the episode ends, and
  ``reward(answer)`` (if any) is what the ``tool_env`` reward reads (`searchrl.rewards.outcome`). The
  instances live in the episode's state (``EnvState.tool_objects``), so state is kept across an episode's
  calls and never shared between episodes.
- Per-tool settings, for every kind: ``description`` and ``parameters`` replace what was read from the code,
  ``timeout`` bounds each call (seconds; a call past it reads an error, its thread is left to finish), and
  ``max_concurrency`` bounds the calls of one step that run at once.

A call that raises, times out or returns something that is not text gives the model an error message; the
run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.types import EnvState
from searchrl.envs.tools import Tool, ToolResult

log = logging.getLogger(__name__)


def _schema(fn: Callable[..., Any], what: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return dict(get_json_schema(fn)["function"])
    except Exception as exc:
        raise DataError(
            f"tool {what}: cannot read its schema ({exc}); give every argument a type hint and describe it "
            "under 'Args:' in the docstring"
        ) from exc


def _as_result(value: Any) -> ToolResult:
    """A function's return value as what the model reads: text, or ``(text, docs)``."""
    if isinstance(value, ToolResult):
        return value
    text, docs = value if isinstance(value, tuple) and len(value) == 2 else (value, ())
    return ToolResult(str(text), tuple(docs))


def _error(exc: BaseException, timeout: float | None) -> ToolResult:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return ToolResult(f"Error: the tool did not answer within {timeout:g} s.", error="tool_timeout")
    return ToolResult(f"Error: {type(exc).__name__}: {exc}", error="tool_error")


def call_all(
    jobs: Sequence[tuple[Callable[..., Any], dict[str, Any]]],
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> list[ToolResult]:
    """Each (function, arguments) called, one result each. Plain functions with neither bound run one after
    the other in this thread; otherwise on an event loop, ``async def`` functions awaited and the others in
    threads, at most ``max_concurrency`` at once, each bounded by ``timeout``."""
    is_async = any(inspect.iscoroutinefunction(f) for f, _ in jobs)
    if not is_async and timeout is None and max_concurrency is None:
        out = []
        for f, args in jobs:
            try:
                out.append(_as_result(f(**args)))
            except Exception as exc:  # the model's call failed: it reads why, the run goes on
                out.append(_error(exc, timeout))
        return out
    return _in_loop(lambda: _gather(jobs, timeout, max_concurrency or len(jobs)))


async def _gather(
    jobs: Sequence[tuple[Callable[..., Any], dict[str, Any]]], timeout: float | None, limit: int
) -> list[ToolResult]:
    gate = asyncio.Semaphore(max(1, limit))
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, limit), thread_name_prefix="searchrl-tool"
    )
    loop = asyncio.get_running_loop()

    async def one(f: Callable[..., Any], args: dict[str, Any]) -> ToolResult:
        async with gate:
            try:
                if inspect.iscoroutinefunction(f):
                    value = await asyncio.wait_for(f(**args), timeout)
                else:
                    value = await asyncio.wait_for(loop.run_in_executor(pool, lambda: f(**args)), timeout)
                return _as_result(value)
            except Exception as exc:
                return _error(exc, timeout)

    try:
        return list(await asyncio.gather(*(one(f, a) for f, a in jobs)))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a call past its timeout is not waited for


def _in_loop(make: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from synchronous code, also where this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("out", asyncio.run(make())), daemon=True)
    t.start()
    t.join()
    return box["out"]


def configured(
    tool: Tool,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Tool:
    """``tool`` with its description or argument schema replaced (per-tool settings)."""
    if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type") == "object"):
        raise DataError(f"tool {tool.name}: parameters must be a JSON schema object ({{type: object, …}})")
    return replace(
        tool,
        description=tool.description if description is None else str(description),
        parameters=tool.parameters if parameters is None else dict(parameters),
    )


def function_tool(
    fn: Callable[..., Any],
    name: str | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Tool:
    """A Python function (or ``async def``) as a tool, called once per call; it returns the text the model
    reads, or ``(text, docs)``."""
    spec = _schema(fn, repr(getattr(fn, "__qualname__", fn)))

    def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
        return call_all([(fn, args) for args, _ in calls], timeout, max_concurrency)

    return Tool(name or spec["name"], spec.get("description", ""), spec.get("parameters", {}), run)


def class_tools(
    cls: type,
    key: str,
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
    retriever: Any = None,
) -> list[Tool]:
    """The public methods of ``cls`` (not ``reset``, ``release``, ``reward``) as tools on one instance per
    episode, made with ``cls(**kwargs)`` at the episode's first call and kept in its state under ``key``. A
    constructor with a ``retriever`` parameter gets the environment's retriever (unless ``kwargs`` set it)."""
    kwargs = dict(kwargs or {})
    if "retriever" in inspect.signature(cls).parameters and "retriever" not in kwargs:
        kwargs["retriever"] = retriever
    reserved = {"reset", "release", "reward"}
    names = [
        n
        for n, member in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not n.startswith("_") and n not in reserved
    ]
    if not names:
        raise DataError(f"tool class {cls.__qualname__}: no public method to offer as a tool")

    def instance(state: EnvState) -> Any:
        obj = state.tool_objects.get(key)
        if obj is None:
            obj = state.tool_objects[key] = cls(**kwargs)
            if callable(getattr(obj, "reset", None)):
                obj.reset(state.example)
        return obj

    def make(method: str) -> Tool:
        spec = _schema(getattr(cls, method), f"{cls.__qualname__}.{method}")
        props = dict(spec.get("parameters", {}).get("properties", {}))
        props.pop("self", None)
        params = {**spec.get("parameters", {}), "properties": props}
        params["required"] = [r for r in params.get("required", []) if r != "self"]

        def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
            return call_all(
                [(getattr(instance(state), method), args) for args, state in calls], timeout, max_concurrency
            )

        return Tool(method, spec.get("description", ""), params, run)

    return [make(n) for n in names]


def settle(state: EnvState) -> None:
    """An episode ended (its answer, its budget, or its length): each tool object's ``reward(answer)`` is
    read into ``state.tool_reward`` (their sum; the ``tool_env`` reward), then its ``release()`` called, and
    the objects forgotten. A user's method that raises gives reward 0 (and a warning) or is ignored (release):
    the episode is over either way."""
    scores = []
    for key, obj in state.tool_objects.items():
        if callable(getattr(obj, "reward", None)):
            try:
                scores.append(float(obj.reward(state.answer)))
            except Exception as exc:
                log.warning(
                    "tool object %s: reward() raised %s: %s; its reward is 0", key, type(exc).__name__, exc
                )
                scores.append(0.0)
        release = getattr(obj, "release", None)
        if callable(release):
            try:
                release()
            except Exception as exc:
                log.warning("tool object %s: release() raised %s: %s", key, type(exc).__name__, exc)
    if scores:
        state.tool_reward = sum(scores)
    state.tool_objects.clear()
