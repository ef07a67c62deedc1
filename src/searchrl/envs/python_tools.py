"""The tools users bring, as TRL and verl take them: Python functions (sync or ``async def``), and stateful
environments whose public methods are the tools.

- `function_tool`: one function, its schema read from its type hints and Google-style docstring
  (transformers' ``get_json_schema``, as TRL's ``tools=[...]``). ``async def`` functions are awaited.
- `class_tools`: a class, one instance per episode (TRL's ``environment_factory``; verl's per-trajectory
  create / execute / release). The instance is made when the episode starts (`ToolObjects.start`, from
  `ToolEnv.reset`), then its ``reset`` runs: ``reset(example)`` (ours) or ``reset(**row)`` (TRL's: the
  example's fields as keywords, ``question``/``prompt``, ``answers``, ``id`` and its metadata); text it
  returns is appended to the user's message, as TRL does. Its other public methods are the tools;
  ``reward(answer)`` or ``get_reward()`` (TRL's) is read when the episode ends, for every episode, whether or
  not it called a tool (the ``tool_env`` reward, `searchrl.rewards.outcome`); ``release()`` (if any) runs
  then. ``reset``, ``release``, ``reward`` and ``get_reward`` are never offered to the model. The instances
  live in the episode's state (``EnvState.tool_objects``), so state is kept across an episode's calls and
  never shared between episodes; an episode's calls to its instance run in the order they were made.
- Per-tool settings, for every kind: ``description`` and ``parameters`` replace what was read from the code,
  ``timeout`` bounds each call (seconds, default `DEFAULT_TIMEOUT`; ``null``: unbounded, and the call runs in
  the trainer's own thread, for code that must stay on the thread that made its objects), and
  ``max_concurrency`` bounds the calls of one step that run at once.

Whatever a tool does is an observation, never an exception: a call that raises (``SystemExit`` from an
argparse inside a tool included, or an exception whose message itself raises), times out, blocks its event
loop, ignores cancellation, or returns something that is not text (bytes, tuples, objects) gives the model a
message; a constructor or ``reset`` that raises makes that episode's calls read why. Each bounded call runs
on a daemon thread (reused from call to call; a coroutine on an event loop of that thread), so a call past
its timeout is left behind on its thread, its late result dropped, and never delays the interpreter's exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.core.types import EnvState
from searchrl.envs.tools import Tool, ToolResult

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # seconds a Python tool's call may take unless its spec says otherwise
LIFECYCLE = ("reset", "release", "reward", "get_reward")  # a tool class's methods that are never tools


def _schema(fn: Callable[..., Any], what: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return dict(get_json_schema(fn)["function"])
    except Exception as exc:
        raise DataError(
            f"tool {what}: cannot read its schema ({exc}); give every argument a type hint and describe it "
            "under 'Args:' in the docstring"
        ) from exc


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, even one whose ``__str__`` raises."""
    try:
        message = str(exc)
    except Exception:
        message = "(its message cannot be shown)"
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _is_docs(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(d, Doc) for d in value)


def as_result(value: Any) -> ToolResult:
    """A tool's return value as what the model reads, never raising: a `ToolResult` (its text made text, its
    documents kept if they are `Doc`s), ``(text, docs)`` where ``docs`` is a sequence of `Doc`s, or anything
    else as its text (bytes decoded; a tuple such as ``("Paris", "France")`` is one value, not text and
    documents)."""
    try:
        if isinstance(value, ToolResult):
            docs = value.docs if isinstance(value.docs, (list, tuple)) else ()
            error = value.error if isinstance(value.error, str) else None
            return ToolResult(_text(value.text), tuple(d for d in docs if isinstance(d, Doc)), error)
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and _is_docs(value[1]):
            return ToolResult(value[0], tuple(value[1]))
        return ToolResult(_text(value))
    except Exception as exc:
        detail = describe(exc)
        return ToolResult(
            f"Error: the tool returned a value that cannot be shown as text ({detail}).",
            error="non_text_result",
        )


def error_result(exc: BaseException, timeout: float | None = None) -> ToolResult:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return ToolResult(f"Error: the tool did not answer within {timeout or 0:g} s.", error="tool_timeout")
    return ToolResult(f"Error: {describe(exc)}", error="tool_error")


async def _await(x: Any) -> Any:
    return await x


def _invoke(fn: Callable[..., Any], args: dict[str, Any]) -> Any:
    """``fn(**args)``, a coroutine it returns run to its end on an event loop of this thread (of a thread of
    its own where this one already runs a loop)."""
    value = fn(**args)
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(value))
    return spawn(lambda: asyncio.run(_await(value)), {}).result()


class _DaemonPool:
    """Daemon worker threads, reused: a call is handed to an idle one, or to a new one when none is idle
    (a call that hangs keeps its thread, and later calls never wait behind it). Daemon threads never delay
    the interpreter's exit, which ``concurrent.futures``' pools do (they are joined at exit)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[..., Any], dict[str, Any], concurrent.futures.Future[Any]]
        ]
        self._jobs = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], args: dict[str, Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="searchrl-tool", daemon=True).start()
        self._jobs.put((fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            fn, args, fut = self._jobs.get()
            try:
                value = _invoke(fn, args)
            except BaseException as exc:  # a tool's SystemExit or KeyboardInterrupt must not end the trainer
                fut.set_exception(exc)
            else:
                fut.set_result(value)
            del fn, args, fut
            with self._lock:
                self._idle += 1


_POOL = _DaemonPool()


def spawn(fn: Callable[..., Any], args: dict[str, Any]) -> concurrent.futures.Future[Any]:
    """``fn(**args)`` on a daemon thread (`_DaemonPool`): its value, or whatever it raised (``SystemExit``
    included), on the future. A caller that stops waiting leaves the call behind; the process can exit."""
    return _POOL.submit(fn, args)


def call_all(
    jobs: Sequence[tuple[Callable[..., Any], dict[str, Any]]],
    timeout: float | None = DEFAULT_TIMEOUT,
    max_concurrency: int | None = None,
) -> list[ToolResult]:
    """Each (function, arguments) called, one result each, in order. With a ``timeout``, each call runs in a
    thread of its own (`spawn`), at most ``max_concurrency`` at once (default all), and a call not done
    within ``timeout`` seconds reads an error and is left behind. Without one, the calls run one after the
    other in this thread (``async def`` ones awaited), unbounded."""
    if timeout is None:
        out = []
        for f, args in jobs:
            try:
                out.append(as_result(_invoke(f, args)))
            except BaseException as exc:  # the model's call failed: it reads why, the run goes on
                if isinstance(exc, KeyboardInterrupt):
                    raise
                out.append(error_result(exc))
        return out
    results: list[ToolResult | None] = [None] * len(jobs)
    waiting = deque(range(len(jobs)))
    running: dict[concurrent.futures.Future[Any], tuple[int, float]] = {}
    limit = max(1, max_concurrency or len(jobs))
    while waiting or running:
        while waiting and len(running) < limit:
            i = waiting.popleft()
            running[spawn(*jobs[i])] = (i, time.monotonic() + timeout)
        soonest = min(d for _, d in running.values())
        done, _ = concurrent.futures.wait(
            running, max(0.0, soonest - time.monotonic()), concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            i, _ = running.pop(fut)
            failed = fut.exception()
            results[i] = as_result(fut.result()) if failed is None else error_result(failed, timeout)
        now = time.monotonic()
        for fut, (i, deadline) in list(running.items()):
            if deadline <= now:  # left behind: its thread ends on its own, its result is dropped
                running.pop(fut)
                results[i] = error_result(TimeoutError(), timeout)
    return [r if r is not None else error_result(RuntimeError("no result"), timeout) for r in results]


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
    timeout: float | None = DEFAULT_TIMEOUT,
    max_concurrency: int | None = None,
) -> Tool:
    """A Python function (or ``async def``) as a tool, called once per call; it returns the text the model
    reads, or ``(text, docs)``."""
    spec = _schema(fn, repr(getattr(fn, "__qualname__", fn)))

    def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
        return call_all([(fn, args) for args, _ in calls], timeout, max_concurrency)

    return Tool(name or spec["name"], spec.get("description", ""), spec.get("parameters", {}), run)


@dataclass(frozen=True)
class _Failed:
    """An episode's tool object that could not be made or reset: why."""

    why: str


_warned: set[str] = set()
_TIMEOUTS: dict[
    str, float | None
] = {}  # each tool class's timeout, by its key (its objects' reward and release)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s (said once per tool class)", message)


@dataclass(frozen=True)
class ToolObjects:
    """One tool class's per-episode instances: made and reset when an episode starts (`start`), kept in the
    episode's state under ``key``."""

    cls: type
    key: str
    kwargs: dict[str, Any]
    timeout: float | None = DEFAULT_TIMEOUT

    def start(self, state: EnvState) -> str | None:
        """Make this episode's instance and reset it; the text its ``reset`` returned (appended to the user's
        message), or None. A constructor or ``reset`` that raises or hangs is recorded: the episode's calls
        read why, its reward is 0."""
        _TIMEOUTS[self.key] = self.timeout  # its reward and release are bounded alike (`settle`)
        try:
            obj, note = _bounded(functools.partial(_make, self.cls, self.kwargs, state.example), self.timeout)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = (
                f"did not start within {self.timeout:g} s"
                if isinstance(exc, concurrent.futures.TimeoutError)
                else f"raised {describe(exc)}"
            )
            _warn_once(self.key, f"tool class {self.key}: making or resetting an instance {why}")
            state.tool_objects[self.key] = _Failed(why)
            return None
        state.tool_objects[self.key] = obj
        return note


def _make(cls: type, kwargs: dict[str, Any], example: Any) -> tuple[Any, str | None]:
    obj = cls(**kwargs)
    reset = getattr(obj, "reset", None)
    if not callable(reset):
        return obj, None
    note = _invoke(reset, _reset_args(reset, example))
    return obj, None if note is None else _text(note)


def _reset_args(reset: Callable[..., Any], example: Any) -> dict[str, Any]:
    """The arguments ``reset`` takes: ``example`` (ours), or the example's fields by name (TRL passes a
    dataset row's columns as keywords)."""
    params = inspect.signature(reset).parameters
    if "example" in params:
        return {"example": example}
    row = {
        **dict(getattr(example, "metadata", {}) or {}),
        "id": example.id,
        "question": example.question,
        "prompt": example.question,
        "answers": list(example.answers),
        "golden_answers": list(example.answers),
    }
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return row
    named = {k: v for k, v in row.items() if k in params}
    first = next(iter(params.values()), None)
    if not named and first is not None and first.default is inspect.Parameter.empty:
        return {first.name: example}  # one parameter of another name: the example itself
    return named


def class_tools(
    cls: type,
    key: str,
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    max_concurrency: int | None = None,
    retriever: Any = None,
) -> list[Tool]:
    """The public methods of ``cls`` (not `LIFECYCLE`'s) as tools on one instance per episode, made with
    ``cls(**kwargs)`` when the episode starts and kept in its state under ``key``. A constructor with a
    ``retriever`` parameter gets the environment's retriever (unless ``kwargs`` set it)."""
    kwargs = dict(kwargs or {})
    if "retriever" in inspect.signature(cls).parameters and "retriever" not in kwargs:
        kwargs["retriever"] = retriever
    names = [
        n
        for n, member in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not n.startswith("_") and n not in LIFECYCLE
    ]
    if not names:
        raise DataError(f"tool class {cls.__qualname__}: no public method to offer as a tool")
    owner = ToolObjects(cls, key, kwargs, timeout)

    def make(method: str) -> Tool:
        spec = _schema(getattr(cls, method), f"{cls.__qualname__}.{method}")
        props = dict(spec.get("parameters", {}).get("properties", {}))
        props.pop("self", None)
        params = {**spec.get("parameters", {}), "properties": props}
        params["required"] = [r for r in params.get("required", []) if r != "self"]

        def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
            """In waves: the k-th call of every episode in wave k, so that one episode's calls to its
            instance run in order, never at once."""
            out: list[ToolResult | None] = [None] * len(calls)
            waves: dict[int, list[int]] = {}
            seen: dict[int, int] = {}
            for i, (_, state) in enumerate(calls):
                k = seen[id(state)] = seen.get(id(state), -1) + 1
                waves.setdefault(k, []).append(i)
            for wave in waves.values():
                jobs = [_job(calls[i][1], owner, method, calls[i][0]) for i in wave]
                for i, r in zip(wave, call_all(jobs, timeout, max_concurrency)):
                    out[i] = r
            return [r if r is not None else error_result(RuntimeError("no result")) for r in out]

        return Tool(method, spec.get("description", ""), params, run, owner=owner)

    return [make(n) for n in names]


def _job(
    state: EnvState, owner: ToolObjects, method: str, args: dict[str, Any]
) -> tuple[Callable[..., Any], dict[str, Any]]:
    obj = state.tool_objects.get(owner.key)
    if obj is None:  # an episode made before its tools were set (or replayed): started now
        owner.start(state)
        obj = state.tool_objects.get(owner.key)
    if isinstance(obj, _Failed):
        why = obj.why

        def failed() -> ToolResult:
            return ToolResult(
                f"Error: this episode's {owner.key} could not be started: it {why}.", error="tool_error"
            )

        return failed, {}
    return getattr(obj, method), args


def fork(objects: dict[str, Any]) -> dict[str, Any]:
    """A branch's own copies of an episode's tool objects (`rollout.loop.branch`): deep copies, or the same
    object (with a warning) where one cannot be copied."""
    out = {}
    for key, obj in objects.items():
        try:
            out[key] = copy.deepcopy(obj)
        except Exception as exc:
            _warn_once(
                f"fork:{key}", f"tool object {key} cannot be copied for a branch ({describe(exc)}); shared"
            )
            out[key] = obj
    return out


def _bounded(fn: Callable[[], Any], timeout: float | None) -> Any:
    """``fn()`` within ``timeout`` seconds in a thread of its own; unbounded (None), in this thread."""
    if timeout is None:
        return _invoke(fn, {})
    return spawn(fn, {}).result(timeout)


def settle(state: EnvState) -> None:
    """An episode ended (its answer, its budget, or its length): each tool object's ``reward(answer)`` or
    ``get_reward()`` is read into ``state.tool_reward`` (their sum; the ``tool_env`` reward), then its
    ``release()`` called, and the objects forgotten. A reward that raises, hangs or is not a finite number
    is 0 (with a warning), as is that of an object that could not be started; a ``release`` that fails is
    ignored (with a warning): the episode is over either way."""
    scores = []
    for key, obj in state.tool_objects.items():
        if isinstance(obj, _Failed):
            scores.append(0.0)
            continue
        timeout = _TIMEOUTS.get(key, DEFAULT_TIMEOUT)
        reward = getattr(obj, "reward", None)
        get_reward = getattr(obj, "get_reward", None)
        if callable(reward) or callable(get_reward):
            try:
                if callable(reward):
                    value = _bounded(functools.partial(reward, state.answer), timeout)
                else:
                    value = _bounded(get_reward, timeout)  # type: ignore[arg-type]
                score = float(value)
                if not math.isfinite(score):
                    raise ValueError(f"it returned {score}")
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                _warn_once(f"reward:{key}", f"tool object {key}: its reward failed ({describe(exc)}); 0")
                score = 0.0
            scores.append(score)
        release(obj, key, timeout)
    if scores:
        state.tool_reward = sum(scores)
    state.tool_objects.clear()


def release(obj: Any, key: str, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """``obj.release()`` if it has one, bounded (the tool class's timeout), never raising."""
    fn = getattr(obj, "release", None)
    if not callable(fn):
        return
    try:
        _bounded(fn, timeout)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        _warn_once(f"release:{key}", f"tool object {key}: release() failed ({describe(exc)})")


def discard(state: EnvState) -> None:
    """An episode that will not be played (a prompt measured, then dropped): its objects released, no reward."""
    for key, obj in state.tool_objects.items():
        if not isinstance(obj, _Failed):
            release(obj, key, _TIMEOUTS.get(key, DEFAULT_TIMEOUT))
    state.tool_objects.clear()
