"""Episodes played by a user's agent program against the policy's endpoint (``env.protocol: agent``).

The program is a Python function (``module:function``) or a command. Each episode runs it once on a question
with a ``base_url`` of its own (``http://host:port/s/<session>/v1``, an OpenAI-compatible endpoint in front of
the policy being trained, `rollout.policy_endpoint`); it calls the model as it likes (the ``openai`` client, an
agent framework), runs its own tools and returns its answer. A function is called with the keyword arguments it
declares among ``base_url``, ``model`` (the name to send), ``session`` and ``search`` (the run's retriever:
``search(query, k=None) -> str``, documents formatted as the tool protocol shows them, and recorded as the
episode's retrievals for the retrieval rewards and metrics); it returns the answer (a string), or
``{"answer": ..., "retrieved": [doc ids]}``. A command gets ``SEARCHRL_BASE_URL``, ``SEARCHRL_MODEL``,
``SEARCHRL_SESSION`` and ``SEARCHRL_QUESTION`` in its environment; its answer is its standard output's last
non-empty line.

The episode's training rows come from the calls the endpoint recorded, never from text: a call whose prompt
extends an earlier call's prompt and completion continues that call's row (its new ids an observation, what it
sampled an action); a call that extends none (a rewritten history, a sub-agent, a summary) starts a row. Every
row of an episode gets the episode's reward, under one episode id (the rows of a folded episode,
`envs.context.unfold`). Whatever the program does is input: an exception, a hang past ``timeout`` (its session
is closed: its later calls are refused), a bad return value, a call refused for its budget or length: the
episode ends with what it recorded, scored as the reward pipeline scores it (no answer: 0), and is counted
(``agent/*`` metrics).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from searchrl.core.aggregate import Mean, Sum
from searchrl.core.errors import DataError
from searchrl.core.records import Doc, Example
from searchrl.core.types import EnvState, Segment, Step, StepInfo, Trajectory
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.context import FOLDS
from searchrl.envs.tool_env import ToolEnv
from searchrl.rollout.episode import RolloutStats
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.policy_endpoint import Call, PolicyEndpoint, make_policy_app

ARGS = ("base_url", "model", "session", "search")  # what a function program may declare
MODEL_NAME = "policy"


def check_program(path: str | Callable[..., Any]) -> Callable[..., Any]:
    """The program function ``path`` names, or an error saying why it cannot be one: it must take the question
    as its first argument, and any other argument it requires must be one we pass (`ARGS`)."""
    from searchrl.core.registry import import_path

    fn = import_path(path) if isinstance(path, str) else path
    if not callable(fn):
        raise DataError(f"{path!r} is a {type(fn).__name__}, not a function")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn  # a builtin or C function: called as it is
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise DataError(f"{path!r} takes no positional argument: it is called as fn(question, **keywords)")
    unknown = [
        p.name
        for p in params[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ARGS
    ]
    if unknown:
        raise DataError(
            f"{path!r} requires argument(s) {', '.join(unknown)} that the run does not pass; it passes the "
            f"question, then the keywords it declares among {', '.join(ARGS)}"
        )
    return fn


@dataclass
class Played:
    """What one run of the program left: its answer, how it ended, the retrievals it made through ``search``."""

    answer: str | None = None
    ended: str = "answer"  # "answer" | "error" | "timeout" | "bad_return" | "no_answer"
    error: str = ""
    # (index of the call after which it searched, query, documents)
    searches: list[tuple[int, str, tuple[Doc, ...]]] = field(default_factory=list)
    reported: tuple[str, ...] = ()  # doc ids the program reported retrieving


class AgentProgramEnv(ToolEnv):
    """The environment of ``env.protocol: agent``: the tool environment (its chat prompt and search tool, what the
    scripted teacher and the SFT warm start write), whose episodes a program plays against the policy's endpoint
    (`play`, which `rollout.loop.rollout` hands the work to). ``program``: ``module:function`` or a function;
    ``command``: argv (one of the two); ``timeout``: seconds per episode; ``workers``: episodes at once;
    ``max_calls``: model calls per episode; the rest as `ToolEnv`'s."""

    splits_episodes = True  # an episode may train as several rows (`algorithms.grpo` unfolds them)

    def __init__(
        self,
        retriever: Any,
        chat: ChatFormat,
        program: str | Callable[..., Any] | None = None,
        command: Sequence[str] | None = None,
        timeout: float = 300.0,
        workers: int = 64,
        max_calls: int = 8,
        **tool_env: Any,
    ) -> None:
        super().__init__(retriever, chat, **tool_env)
        if (program is None) == (not command):
            raise DataError("env.agent_program: give exactly one of function (module:function) and command")
        if program is not None:
            program = check_program(program)
        self.program, self.command = program, list(command or ())
        self.timeout, self.workers, self.max_calls = timeout, workers, max_calls
        self._search_lock = threading.Lock()  # in-process retrievers are not assumed thread-safe
        self._served: Any = None
        self._endpoint: PolicyEndpoint | None = None

    def close(self) -> None:
        if self._served is not None:
            self._served.stop()
            self._served = None

    # ------------------------------------------------------------------ episodes
    def endpoint(
        self, generator: Any, tokenizer: Any, params: SamplingParams, max_total_tokens: int
    ) -> PolicyEndpoint:
        """The endpoint for this collection (its server started once, on a free local port)."""
        if self._endpoint is None or self._endpoint.generator is not generator:
            self._endpoint = PolicyEndpoint(
                generator, tokenizer, self.format, self.call_format, params.max_new_tokens, max_total_tokens,
                self.max_calls, params,
            )  # fmt: skip
            if self._served is not None:
                self._served.stop()
            from searchrl.core.asgi import Served

            self._served = Served(make_policy_app(self._endpoint, MODEL_NAME, self.timeout), port=0).start()
        ep = self._endpoint
        ep.sampling, ep.max_new_tokens, ep.max_context = params, params.max_new_tokens, max_total_tokens
        return ep

    def play(
        self,
        examples: Sequence[Example],
        generator: Any,
        tokenizer: Any,
        params: SamplingParams,
        group_size: int,
        max_total_tokens: int,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """``group_size`` episodes per example, each a run of the program; their trajectories (the rows of an
        episode that split: `envs.context.FOLDS`) and statistics."""
        t0 = time.perf_counter()
        ep = self.endpoint(generator, tokenizer, params, max_total_tokens)
        ep.version = int(getattr(generator, "version", ep.version))
        jobs = [
            (gi, ex, f"{uuid.uuid4().hex[:12]}-{gi}-{j}")
            for gi, ex in enumerate(examples)
            for j in range(group_size)
        ]
        played = self._run_all(ep, [(ex, s) for _, ex, s in jobs])
        trajs = [self._trajectory(ex, ep.take(s), p, gi, tokenizer) for (gi, ex, s), p in zip(jobs, played)]
        for (_, _, s), p in zip(jobs, played):
            if p.ended != "timeout":  # an abandoned program's session stays closed: late calls are refused
                ep.forget(s)
        stats = _stats(trajs)
        stats.extra.update(agent_metrics(trajs))
        stats.seconds = time.perf_counter() - t0
        return trajs, stats

    def _run_all(self, ep: PolicyEndpoint, jobs: list[tuple[Example, str]]) -> list[Played]:
        """Run every job, ``workers`` at a time, each on a daemon thread. A hung program cannot be stopped, only
        abandoned: when its time is up its session is closed (its later calls are refused) and its worker slot
        goes to the next job, so a program that never returns never holds up the run."""
        out = [Played() for _ in jobs]
        started: list[float | None] = [None] * len(jobs)
        done = [threading.Event() for _ in jobs]
        slots = threading.Semaphore(max(1, self.workers))
        lock = threading.Lock()
        assert self._served is not None
        url = self._served.url

        def finish(i: int) -> None:  # the job's slot, given back once: by its thread or by its expiry
            with lock:
                if not done[i].is_set():
                    done[i].set()
                    slots.release()

        def work(i: int) -> None:
            try:
                started[i] = time.monotonic()
                self._run_one(jobs[i][0], f"{url}/s/{jobs[i][1]}/v1", jobs[i][1], out[i], ep)
            finally:
                finish(i)

        def expire() -> None:
            now = time.monotonic()
            for i, t in enumerate(started):
                if t is not None and not done[i].is_set() and now - t > self.timeout:
                    out[i].ended, out[i].error = "timeout", f"the program ran past {self.timeout:g} s"
                    ep.close(jobs[i][1], "timeout")
                    finish(i)

        for i in range(len(jobs)):
            while not slots.acquire(timeout=0.02):
                expire()
            threading.Thread(target=work, args=(i,), daemon=True, name=f"agent-{i}").start()
        while not all(d.is_set() for d in done):
            time.sleep(0.02)
            expire()
        return out

    def _run_one(self, example: Example, base_url: str, session: str, p: Played, ep: PolicyEndpoint) -> None:
        try:
            if self.program is not None:
                result = self.program(example.question, **self._kwargs(base_url, session, p, ep))
            else:
                result = self._command(example.question, base_url, session)
        except Exception as exc:  # the program's failure is its episode's, never the run's
            if p.ended != "timeout":
                killed = self.command and isinstance(exc, TimeoutError)  # a command past its time
                p.ended, p.error = "timeout" if killed else "error", f"{type(exc).__name__}: {exc}"[:500]
            return
        if p.ended == "timeout":
            return
        if isinstance(result, dict):
            p.reported = tuple(str(d) for d in result.get("retrieved") or () if isinstance(d, str | int))
            result = result.get("answer")
        if result is None:
            p.ended = "no_answer"
        elif isinstance(result, str | int | float) and not isinstance(result, bool):
            p.answer = str(result)
        else:
            p.ended, p.error = "bad_return", f"the program returned {type(result).__name__}, not a string"

    def _kwargs(self, base_url: str, session: str, p: Played, ep: PolicyEndpoint) -> dict[str, Any]:
        def search(query: str, k: int | None = None) -> str:
            q = " ".join(str(query).split())
            if not q:
                return "Error: the query is empty."
            kk = max(1, min(int(k or self.topk), 10))
            with self._search_lock:
                docs = tuple(self.retriever.search([q], kk)[0])
            p.searches.append((len(ep.session(session).calls) - 1, q, docs))
            return self.format_docs(docs)

        offered = {"base_url": base_url, "model": MODEL_NAME, "session": session, "search": search}
        params = inspect.signature(self.program).parameters  # type: ignore[arg-type]
        if any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
            return offered
        return {k: v for k, v in offered.items() if k in params}

    def _command(self, question: str, base_url: str, session: str) -> str | None:
        env = {**os.environ, "SEARCHRL_BASE_URL": base_url, "SEARCHRL_MODEL": MODEL_NAME,
               "SEARCHRL_SESSION": session, "SEARCHRL_QUESTION": question}  # fmt: skip
        try:
            done = subprocess.run(
                self.command, env=env, capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the command ran past {self.timeout:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"the command exited {done.returncode}: {done.stderr.strip()[-300:]}")
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        return lines[-1].strip() if lines else None

    def chat_prompt(self, example: Example) -> str:
        """The question as a one-message chat prompt: the row of an episode that sampled nothing."""
        return self.format.render([{"role": "user", "content": example.question}])

    # ------------------------------------------------------------------ rows
    def _trajectory(
        self, example: Example, session: Any, p: Played, group: int, tokenizer: Any
    ) -> Trajectory:
        """The episode's rows from its recorded calls (module docstring): the last row the trajectory, the
        others its folds, in the order of their first call."""
        calls: list[Call] = session.calls
        rows, where = assemble(calls)
        state = EnvState(example=example, prompt="", done=True)
        state.finish_reason = _finish(p, session.closed, calls)
        state.generated_tokens = sum(len(c.completion_ids) for c in calls)
        infos = _infos(calls, p, state.finish_reason)
        for k, (c, info) in enumerate(zip(calls, infos)):
            state.actions.append(tokenizer.decode(c.completion_ids))
            state.infos.append(info)
            state.retrieved.append([d for s in p.searches if s[0] == k for d in s[2]])
        if not calls:  # nothing sampled: a row of the question alone carries the episode's 0
            state.prompt = self.chat_prompt(example)
            ids = list(tokenizer(state.prompt, add_special_tokens=False)["input_ids"])
            rows = [([Segment("prompt", ids)], [])]
        else:
            state.prompt = tokenizer.decode(calls[0].prompt_ids)
        for r, (_, steps) in enumerate(rows):
            for step in steps:
                step.info = infos[where[(r, step.segment)]]
        last = where.get("last_row", len(rows) - 1)
        t = Trajectory(example, rows[last][0], rows[last][1], state=state, group_id=group)
        t.finish_reason = state.finish_reason
        others = [rows[r] for r in range(len(rows)) if r != last]
        if others:
            t.info[FOLDS] = others
        t.info["agent_rows"] = len(rows)
        return t


def assemble(calls: Sequence[Call]) -> tuple[list[tuple[list[Segment], list[Step]]], dict[Any, int]]:
    """The rows of an episode's calls: each call appended to the row whose tokens its prompt extends (the
    longest), else a new row; per (row, action segment) the call's index, and ``last_row``: the row of the
    last call. A row's tokens are exactly the calls' prompt ids and sampled ids."""
    rows: list[tuple[list[Segment], list[Step]]] = []
    ids: list[list[int]] = []
    where: dict[Any, int] = {}
    for k, c in enumerate(calls):
        best = max(
            (
                r
                for r in range(len(rows))
                if len(ids[r]) <= len(c.prompt_ids) and c.prompt_ids[: len(ids[r])] == ids[r]
            ),
            key=lambda r: len(ids[r]),
            default=None,
        )
        if best is None:
            rows.append(([Segment("prompt", list(c.prompt_ids))], []))
            ids.append(list(c.prompt_ids))
            best = len(rows) - 1
        elif len(c.prompt_ids) > len(ids[best]):
            rows[best][0].append(Segment("observation", list(c.prompt_ids[len(ids[best]) :])))
            ids[best] = list(c.prompt_ids)
        segments, steps = rows[best]
        if c.completion_ids:
            segments.append(Segment("action", list(c.completion_ids), list(c.logprobs)))
            ids[best] = ids[best] + list(c.completion_ids)
            steps.append(Step(len(segments) - 1, len(ids[best]) - 1, StepInfo("call", True)))
            where[(best, len(segments) - 1)] = k
        where["last_row"] = best
    return rows, where


def _finish(p: Played, closed: str | None, calls: Sequence[Call]) -> str:
    if p.ended in ("timeout", "error", "bad_return") and closed in ("budget", "length"):
        return closed  # the program stopped because its call was refused for that reason
    if p.ended == "answer":
        return "answer"
    return p.ended


def _infos(calls: Sequence[Call], p: Played, finish: str) -> list[StepInfo]:
    """Per call: a search when the program searched after it (through ``search``), the answer on the last call
    of an episode that answered, else a plain call; tool calls the model wrote that could not be read make it
    invalid."""
    out = []
    for k, c in enumerate(calls):
        mine = [s for s in p.searches if s[0] == k]
        docs = tuple(d.id for s in mine for d in s[2]) + (p.reported if k == len(calls) - 1 else ())
        if k == len(calls) - 1 and finish == "answer":
            out.append(StepInfo("answer", True, answer=p.answer, doc_ids=docs, calls=c.tools))
        elif mine:
            queries = tuple(q for _, q, _ in mine)
            out.append(StepInfo("search", not c.invalid_calls, query=queries[0], doc_ids=docs, calls=c.tools,
                                queries=queries if len(queries) > 1 else ()))  # fmt: skip
        else:
            out.append(StepInfo("call", not c.invalid_calls, calls=c.tools))
    return out


def _stats(trajs: Sequence[Trajectory]) -> RolloutStats:
    stats = RolloutStats()
    stats.tool_calls["search"] += 0  # reported on every process, 0 where no episode called it
    for t in trajs:
        s = t.episode
        stats.episodes += 1
        stats.actions += len(s.infos)
        stats.invalid_actions += sum(not i.valid for i in s.infos)
        stats.searches += sum(i.kind == "search" for i in s.infos)
        stats.tokens_generated += s.generated_tokens
        stats.finish_reasons[t.finish_reason or "unknown"] += 1
        for i in s.infos:
            stats.tool_calls.update(i.calls)
    return stats


def agent_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per episode: rows, episodes that split into several rows, programs that failed, hung or answered nothing."""
    n = len(trajs)
    rows = [int(t.info.get("agent_rows", 1)) for t in trajs]
    reasons = [t.finish_reason or "" for t in trajs]
    return {
        "agent/rows_per_episode": Mean(sum(rows), n),
        "agent/split_episodes": Mean(sum(r > 1 for r in rows), n),
        "agent/errors": Sum(reasons.count("error") + reasons.count("bad_return")),
        "agent/timeouts": Sum(reasons.count("timeout")),
        "agent/no_answer": Sum(reasons.count("no_answer")),
    }
