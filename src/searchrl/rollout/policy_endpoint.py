"""The policy behind an OpenAI-compatible endpoint that records the exact tokens of every call.

An agent program written against the chat API (the ``openai`` client, an agent framework) talks to the policy
being trained through ``/v1/chat/completions`` (tools, ``n``) or ``/v1/completions``. For every call the endpoint
keeps, under the caller's session (`session_of`), the prompt ids it rendered, the ids it sampled with their
log-probs, and the policy version (`Call`); the trainer builds its rows from those ids, never from text
(docs/design.md §4.1; `rollout.agent_program`).

How a chat call's prompt is rendered. When the conversation extends an exchange this session already had (the
messages of an earlier call, then the reply this endpoint returned to it, then only tool or user messages), the
prompt is that call's prompt ids, the ids it sampled, and the template's text after that assistant turn (the
next messages, the assistant turn opened) tokenized on its own: the same ids our own tool loop builds
(`envs.chat_format`), and the call *extends* the earlier one. Otherwise (the first call, a history the agent
rewrote, a reply it changed, a template that renders the past differently once more messages follow, as Qwen3's
drops reasoning before a new user turn) the whole conversation is rendered by the chat template: a call that
extends nothing, which starts a new training row. Messages are compared as the template reads them: role,
text, reasoning, tool calls (name and arguments, a JSON string and its object alike).

What a caller sends is input: malformed requests are answered 400 with the reason, never a stopped run; a
session whose call budget is spent, whose context is full or that was closed (its episode's time ran out) is
answered 400 / 409 and the reason is kept (`finish_reason`). ``stream: true`` is answered in OpenAI's streamed
format once the call has been sampled and recorded (`stream_chunks`). Sampling: with ``sampling`` set (a training run)
every call samples at the run's temperature and top-p, a request's own ignored; ``max_tokens`` only lowers the
run's ``max_new_tokens``.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from searchrl.envs.call_formats import (
    CODE_OPEN,
    DS_CALLS,
    GEMMA_CALL,
    MISTRAL_CALLS,
    call_ids,
    harmony_answer,
    harmony_reasoning,
    parse,
)
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.tools import Tool
from searchrl.rollout.generator import Generation, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16  # choices one call may ask for
MAX_SESSIONS = 100_000  # sessions a server keeps; past it, the oldest is forgotten
_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)
_CALL_MARKERS = {
    "hermes": "<tool_call>",
    "qwen3_coder": "<tool_call>",
    "glm45": "<tool_call>",
    "mistral": MISTRAL_CALLS,
    "deepseek_v3": DS_CALLS,
    "deepseek_v31": DS_CALLS,
    "gemma4": GEMMA_CALL,
    "gemma3": CODE_OPEN,
}


class Refused(Exception):
    """A call the endpoint answers with an HTTP error: ``status`` and the reason (OpenAI's error ``code``)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Call:
    """One sampled completion of a session: what the policy was conditioned on and what it sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    finish: str  # "stop" | "length" | "tool_calls"
    extends: int | None  # index (in the session) of the call whose prompt and completion this prompt extends
    messages: list[tuple[Any, ...]] | None = None  # the conversation as the template reads it (chat calls)
    reply: tuple[Any, ...] | None = None  # the assistant message returned, normalised like `messages`
    tools: tuple[str, ...] = ()  # the calls the reply made, by tool name
    invalid_calls: int = 0  # tool calls the model wrote that could not be read (returned as text)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": self.logprobs,
            "version": self.version,
            "finish_reason": self.finish,
            "extends": self.extends,
            "tool_calls": list(self.tools),
        }


@dataclass
class Session:
    calls: list[Call] = field(default_factory=list)
    closed: str | None = None  # why no more calls are taken ("timeout", "budget", "length")


@dataclass
class ChatRequest:
    """One parsed call: its session, rendered prompt, sampling budget and (chat calls) its messages and tools."""

    session: str
    prompt_ids: list[int]
    extends: int | None
    max_new: int
    temperature: float
    top_p: float
    n: int = 1
    messages: list[tuple[Any, ...]] | None = None
    tools: dict[str, Tool] = field(default_factory=dict)


class PolicyEndpoint:
    """Renders, samples and records the calls of agent programs (module docstring). ``generator``: the policy's
    (one call at a time: the server batches concurrent requests into one `generate`); ``chat``: the model's
    chat template; ``call_format``: how it writes tool calls (`envs.call_formats`); ``max_context``: prompt and
    completion together; ``max_calls``: calls per session (None: no cap); ``sampling``: fixed sampling (a
    training run) or None (each request's temperature and top-p, defaults 1.0)."""

    def __init__(
        self,
        generator: Any,
        tokenizer: Any,
        chat: ChatFormat,
        call_format: str = "hermes",
        max_new_tokens: int = 512,
        max_context: int = 4096,
        max_calls: int | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.generator, self.tokenizer, self.chat, self.call_format = generator, tokenizer, chat, call_format
        # what a template that renders no tool schemas describes (`ChatFormat.render`)
        chat.call_format = call_format
        self.max_new_tokens, self.max_context, self.max_calls = max_new_tokens, max_context, max_calls
        self.sampling = sampling
        self.version = 0  # the policy version each call records (the trainer's step)
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sessions
    def session(self, name: str) -> Session:
        with self._lock:
            if name not in self.sessions and len(self.sessions) >= MAX_SESSIONS:  # a long-lived server
                self.sessions.pop(next(iter(self.sessions)))  # forgets its oldest session
            return self.sessions.setdefault(name, Session())

    def close(self, name: str, reason: str) -> None:
        """Take no more calls for ``name`` (its episode ended: ``reason``)."""
        s = self.session(name)
        s.closed = s.closed or reason

    def take(self, name: str) -> Session:
        """The session's record, removed from the endpoint (later calls under that name are refused)."""
        with self._lock:
            s = self.sessions.pop(name, Session())
            self.sessions[name] = Session(closed=s.closed or "taken")
        return s

    def forget(self, name: str) -> None:
        with self._lock:
            self.sessions.pop(name, None)

    # ------------------------------------------------------------------ requests
    def chat_request(self, session: str, body: dict[str, Any]) -> ChatRequest:
        """A ``/v1/chat/completions`` body as a request: validated, rendered (extending where it can)."""
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        _tool_choice(body.get("tool_choice"), tools)
        schemas = [t.schema for t in tools.values()] if body.get("tool_choice") != "none" else []
        norm = [_norm(m) for m in messages]
        s = self._open(session)
        ids, extends = self._extended(s, messages, norm, schemas)
        if ids is None:
            ids = self._encode(self.chat.render(_escaped(messages, self.chat), schemas))
        return self._request(session, body, ids, extends, norm, tools)

    def completion_request(self, session: str, body: dict[str, Any]) -> ChatRequest:
        """A ``/v1/completions`` body: ``prompt`` text (tokenized as is) or token ids, taken literally."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise Refused(f"prompt token ids must be in [0, {vocab})")
            ids = list(prompt)
        else:
            raise Refused("'prompt' must be a string or a non-empty list of token ids (one prompt per call)")
        s = self._open(session)
        extends = _longest_extended(s.calls, ids)
        return self._request(session, body, ids, extends, None, {})

    def _open(self, session: str) -> Session:
        s = self.session(session)
        if s.closed == "timeout":
            raise Refused(
                f"session {session!r} is closed: its episode ran out of time", 409, "session_closed"
            )
        if s.closed:
            raise Refused(f"session {session!r} is closed ({s.closed})", 409, "session_closed")
        return s

    def _request(
        self,
        session: str,
        body: dict[str, Any],
        ids: list[int],
        extends: int | None,
        norm: list[tuple[Any, ...]] | None,
        tools: dict[str, Tool],
    ) -> ChatRequest:
        room = self.max_context - len(ids)
        if room < 1:
            self.session(session).closed = "length"
            raise Refused(
                f"the prompt is {len(ids)} tokens; this endpoint's context is {self.max_context}",
                400,
                "context_length_exceeded",
            )
        wanted = body.get("max_completion_tokens", body.get("max_tokens"))
        cap = self.sampling.max_new_tokens if self.sampling is not None else self.max_new_tokens
        if wanted is not None:
            cap = min(cap, _int(wanted, "max_tokens", 1, 10**9))
        n = _int(body.get("n", 1), "n", 1, MAX_N)
        s = self.session(session)
        # the budget counts completions, not requests: each may start a training row, and the trainer sizes a
        # step by this budget (`algorithms.grpo`)
        if self.max_calls is not None and len(s.calls) + n > self.max_calls:
            # spent, the session ends; otherwise a smaller n may still fit
            if len(s.calls) >= self.max_calls:
                s.closed = "budget"
            raise Refused(
                f"the session's call budget ({self.max_calls} completions) has {self.max_calls - len(s.calls)} "
                f"left, fewer than n={n}",
                400,
                "call_budget_spent",
            )
        if self.sampling is not None:
            temperature, top_p = self.sampling.temperature, self.sampling.top_p
        else:
            temperature = _number(body.get("temperature", 1.0), "temperature", 0.0, 2.0)
            top_p = _number(body.get("top_p", 1.0), "top_p", 1e-6, 1.0)
        if not isinstance(body.get("stream", False), bool):
            raise Refused("'stream' must be true or false")
        if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
            raise Refused("'stream_options' must be an object such as {\"include_usage\": true}")
        return ChatRequest(session, ids, extends, min(cap, room), temperature, top_p, n, norm, tools)

    def _extended(
        self, s: Session, messages: list[dict[str, Any]], norm: list[tuple[Any, ...]], schemas: list[Any]
    ) -> tuple[list[int] | None, int | None]:
        """The prompt as an extension of the session's latest call whose conversation and reply open this one,
        followed by tool or user messages only (module docstring); (None, None) where none does."""
        for i in range(len(s.calls) - 1, -1, -1):
            c = s.calls[i]
            k = len(c.messages or ())
            if c.messages is None or len(norm) <= k + 1 or norm[:k] != c.messages or norm[k] != c.reply:
                continue
            if any(m["role"] not in ("tool", "user") for m in messages[k + 1 :]):
                continue
            shown = _escaped(messages, self.chat)
            before = self.chat.render(shown[: k + 1], schemas, opened=False)
            after = self.chat.render(shown, schemas)
            if not after.startswith(before):
                return None, None  # the template renders the past differently now: a new row
            return c.prompt_ids + c.completion_ids + self._encode(self._after_turn(c, before, after)), i
        return None, None

    def _after_turn(self, c: Call, before: str, after: str) -> str:
        """The template's text after call ``c``'s sampled turn: the rest of how it closes that turn (Qwen: the
        newline after ``<|im_end|>``), or, for a template that closes none (GLM-4.5), the next messages less the
        marker the model sampled to end its turn; plus the new messages and the assistant turn opened."""
        sampled = self.tokenizer.decode(c.completion_ids, skip_special_tokens=False)
        ended = next((e for e in self.chat.ends if sampled.rstrip().endswith(e)), None)
        closed = before.rstrip()
        close = next((e for e in self.chat.ends if closed.endswith(e)), None)
        new = after[len(before) :]
        # the template closes the turn: what follows its marker (the marker too, if the model did not sample it)
        if close is not None:
            at = closed.rfind(close)
            return (before[at + len(close) :] if ended else before[at:]) + new
        if ended is not None and new.startswith(ended):  # the marker the model sampled opens what follows
            return new[len(ended) :]
        return new

    # ------------------------------------------------------------------ sampling
    def run(self, requests: list[ChatRequest]) -> list[list[tuple[Call, dict[str, Any]]]]:
        """Sample every request's ``n`` completions (one `generate` per budget), record them; per request, its
        (call, OpenAI choice) pairs."""
        flat = [(r, j) for r in requests for j in range(r.n)]
        gens: list[Generation | None] = [None] * len(flat)
        for key in sorted({(r.max_new, r.temperature, r.top_p) for r, _ in flat}):
            idx = [i for i, (r, _) in enumerate(flat) if (r.max_new, r.temperature, r.top_p) == key]
            params = SamplingParams(key[1], key[2], key[0])
            for i, g in zip(idx, self.generator.generate([flat[i][0].prompt_ids for i in idx], params)):
                gens[i] = g
        out: list[list[tuple[Call, dict[str, Any]]]] = [[] for _ in requests]
        where = {id(r): i for i, r in enumerate(requests)}
        for (r, j), g in zip(flat, gens):
            assert g is not None
            out[where[id(r)]].append(self._record(r, j, g))
        return out

    def _record(self, r: ChatRequest, index: int, g: Generation) -> tuple[Call, dict[str, Any]]:
        text = self.tokenizer.decode(g.token_ids, skip_special_tokens=False)
        length = g.finish == "length"
        if r.messages is None:  # a plain completion
            call = Call(
                r.prompt_ids,
                list(g.token_ids),
                list(g.logprobs),
                self.version,
                "length" if length else "stop",
                r.extends,
            )
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": call.finish}
        else:
            message, names, invalid = self._reply(text, r.tools)
            finish = "length" if length else ("tool_calls" if names else "stop")
            call = Call(
                r.prompt_ids, list(g.token_ids), list(g.logprobs), self.version, finish, r.extends,
                r.messages, _norm(message), names, invalid,
            )  # fmt: skip
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        s = self.session(r.session)
        with self._lock:
            s.calls.append(call)
        return call, choice

    def _reply(self, text: str, tools: dict[str, Tool]) -> tuple[dict[str, Any], tuple[str, ...], int]:
        """The assistant message of a sampled turn: its reasoning, its text and the tool calls it made. A turn
        with a call that cannot be read returns whole as text (as vLLM's parsers do), its calls not run."""
        turn = text[: self.chat.turn_end(text)]
        if self.chat.opens_think:
            turn = "<think>" + turn
        if self.call_format == "gpt_oss":
            return self._harmony_reply(turn, tools)
        message: dict[str, Any] = {"role": "assistant", "content": turn}
        m = _THINK.match(turn)
        if m:
            message["reasoning_content"], turn = m.group(1).strip(), turn[m.end() :]
        calls = parse(self.call_format, turn, tools) if tools else []
        if not calls or any(not c.valid for c in calls):
            message["content"] = turn.strip()
            return message, (), sum(not c.valid for c in calls)
        marker = _CALL_MARKERS.get(self.call_format)
        content = turn[: turn.find(marker)].strip() if marker and marker in turn else ""
        message["content"] = content or None
        # the model's own ids where it wrote them (Mistral's, which its template renders back), else new ones
        ids = (
            call_ids(calls)
            if self.call_format == "mistral"
            else [f"call_{uuid.uuid4().hex[:24]}" for _ in calls]
        )
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c, i in zip(calls, ids)
        ]
        return message, tuple(str(c.name) for c in calls), 0

    def _harmony_reply(
        self, turn: str, tools: dict[str, Tool]
    ) -> tuple[dict[str, Any], tuple[str, ...], int]:
        """`_reply` for harmony (gpt-oss): the reasoning is the analysis channel, the text the final channel's."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        reasoning = harmony_reasoning(turn)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        calls = parse(self.call_format, turn, tools) if tools else []
        if not calls or any(not c.valid for c in calls):
            message["content"] = harmony_answer(turn).strip() if not calls else turn.strip()
            return message, (), sum(not c.valid for c in calls)
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
        ]  # fmt: skip
        return message, tuple(str(c.name) for c in calls), 0

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _tool_choice(choice: Any, tools: dict[str, Tool]) -> None:
    """``tool_choice`` checked: auto, none, required, or a named function the request offers. Required and named
    choices are taken but not enforced: the reply is what the policy sampled (a constrained sample would not have
    the behaviour log-probs the trainer uses), a turn without a call coming back as text (agent frameworks such as
    smolagents ask for ``required`` on every call and handle a reply without one)."""
    if choice in (None, "auto", "none", "required"):
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise Refused(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    if name not in tools:
        raise Refused(f"tool_choice names {name[:80]!r}, which is not among the request's tools")


# ---------------------------------------------------------------------- the messages as the template reads them


def _messages(value: Any) -> list[dict[str, Any]]:
    """The request's messages, checked, as the template takes them: text content (a list of text parts
    joined), tool-call arguments as objects."""
    if not isinstance(value, list) or not value:
        raise Refused("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise Refused(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}")
        msg: dict[str, Any] = {
            "role": m["role"],
            "content": _text(m.get("content"), f"messages[{i}].content"),
        }
        if m.get("name") is not None:
            msg["name"] = str(m["name"])
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = _calls(m["tool_calls"], i)
        out.append(msg)
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise Refused(f"{where} must be a string, null or a list of text parts")


def _calls(value: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise Refused(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Refused(
                f"messages[{i}].tool_calls[{j}] must be {{type: function, function: {{name, arguments}}}}"
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):  # a JSON string, as the API sends it; text that is not JSON is kept as sent
            args = _loaded(args) if args.strip() else {}
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if c.get("id") is not None:
            call["id"] = str(c["id"])
        out.append(call)
    return out


def _norm(m: dict[str, Any]) -> tuple[Any, ...]:
    """A message as the template reads it, comparable: role, text, reasoning, the calls' names and arguments
    (ids and the text of a content-less call aside)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(_loaded(c["function"].get("arguments", {})), sort_keys=True))
        for c in m.get("tool_calls") or ()
    )
    return (
        m["role"],
        (m.get("content") or "").strip(),
        (m.get("reasoning_content") or "").strip(),
        calls,
        m.get("name"),
    )


def _loaded(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _escaped(messages: list[dict[str, Any]], chat: ChatFormat) -> list[dict[str, Any]]:
    """What callers wrote as text (every role but the assistant's) with special tokens' text broken up, so that
    a ``<|im_end|>`` in a document or a question never becomes the token that ends a turn."""
    return [m if m["role"] == "assistant" else {**m, "content": chat.escape(m["content"])} for m in messages]


def _tools(value: Any) -> dict[str, Tool]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise Refused("'tools' must be a list of {type: function, function: {name, description, parameters}}")
    out: dict[str, Tool] = {}
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Refused(
                f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}"
            )
        params: dict[str, Any] = (
            fn["parameters"] if isinstance(fn.get("parameters"), dict) else {"type": "object"}
        )
        out[fn["name"]] = Tool(fn["name"], str(fn.get("description", "")), params, run=_never)
    return out


def _never(calls: list[Any]) -> list[Any]:
    raise RuntimeError("the endpoint reads tool calls; the agent program runs its tools")


def _longest_extended(calls: list[Call], ids: list[int]) -> int | None:
    best, size = None, -1
    for i, c in enumerate(calls):
        n = len(c.prompt_ids) + len(c.completion_ids)
        if (
            n > size
            and n <= len(ids)
            and ids[: len(c.prompt_ids)] == c.prompt_ids
            and ids[len(c.prompt_ids) : n] == c.completion_ids
        ):
            best, size = i, n
    return best


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise Refused(f"'{name}' must be an integer from {low} to {high}, got {value!r}")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise Refused(f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- the HTTP app


def stream_chunks(reply: dict[str, Any], chat: bool, usage: bool) -> list[dict[str, Any]]:
    """A whole reply as the chunks of OpenAI's streamed format (``stream: true``). The call is sampled whole and
    recorded before anything is sent (its ids are what the trainer uses), then streamed: per choice, the role,
    the reasoning, the text and each tool call (id, name, arguments) as deltas, then its finish reason; with
    ``stream_options.include_usage`` a last chunk with no choices and the usage. Accumulating the deltas, as the
    ``openai`` client and agent frameworks do, gives the reply unstreamed."""
    head = {k: reply[k] for k in ("id", "created", "model")}
    kind = "chat.completion.chunk" if chat else "text_completion"
    out: list[dict[str, Any]] = []

    def chunk(index: int, part: dict[str, Any], finish: str | None = None) -> None:
        body = {"index": index, **part, "logprobs": None, "finish_reason": finish}
        out.append({**head, "object": kind, "choices": [body]})

    for c in reply["choices"]:
        i = c["index"]
        if not chat:
            chunk(i, {"text": c["text"]})
            chunk(i, {"text": ""}, c["finish_reason"])
            continue
        m = c["message"]
        chunk(i, {"delta": {"role": "assistant", "content": ""}})
        if m.get("reasoning_content"):
            chunk(i, {"delta": {"reasoning_content": m["reasoning_content"]}})
        if m.get("content"):
            chunk(i, {"delta": {"content": m["content"]}})
        for j, call in enumerate(m.get("tool_calls") or []):
            chunk(i, {"delta": {"tool_calls": [{"index": j, **call}]}})
        chunk(i, {"delta": {}}, c["finish_reason"])
    if usage:
        out.append({**head, "object": kind, "choices": [], "usage": reply["usage"]})
    return out


async def _events(chunks: list[dict[str, Any]]) -> Any:
    """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
    for c in chunks:
        yield f"data: {json.dumps(c)}\n\n"
    yield "data: [DONE]\n\n"


def session_of(request: Any, body: dict[str, Any]) -> str:
    """The session a call belongs to: the path's ``/s/{session}/v1/...`` (what `agent_program` hands an agent
    as its ``base_url``), else the ``X-Session-Id`` header, else the body's ``user`` field, else ``default``."""
    name = request.path_params.get("session") or request.headers.get("x-session-id") or body.get("user")
    return str(name) if name else "default"


def make_policy_app(endpoint: PolicyEndpoint, name: str = "policy", timeout: float = 600.0) -> Any:
    """The ASGI app: ``POST /v1/chat/completions``, ``POST /v1/completions`` (each also under
    ``/s/{session}``), ``GET /v1/models``, ``GET /v1/sessions/{session}`` (the recorded calls), ``GET /health``."""
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from searchrl.core.asgi import Batcher, json_app, read_json, with_timeout

    batcher = Batcher(lambda key, reqs: endpoint.run(reqs), max_items=256)

    def error(message: str, code: str = "invalid_request_error") -> dict[str, Any]:
        return {"error": {"message": message, "type": "invalid_request_error", "code": code}}

    async def answer(request: Any, chat: bool) -> Any:
        body = await read_json(request)
        session = session_of(request, body)
        try:
            req = (endpoint.chat_request if chat else endpoint.completion_request)(session, body)
        except Refused as exc:
            return JSONResponse(error(str(exc), exc.code), status_code=exc.status)
        pairs = await with_timeout(batcher.submit("generate", req), timeout)
        completion = sum(len(c.completion_ids) for c, _ in pairs)
        reply = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", name),
            "choices": [choice for _, choice in pairs],
            "usage": {
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(req.prompt_ids) + completion,
            },
        }
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _events(stream_chunks(reply, chat, usage)), media_type="text/event-stream"
            )
        return JSONResponse(reply)

    async def chat(request: Any) -> Any:
        return await answer(request, True)

    async def completions(request: Any) -> Any:
        return await answer(request, False)

    async def models(request: Any) -> Any:
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "searchrl"}]}
        )

    async def session(request: Any) -> Any:
        s = endpoint.sessions.get(request.path_params["session"])
        if s is None:
            return JSONResponse(error("no such session", "not_found"), status_code=404)
        return JSONResponse({"calls": [c.to_json() for c in s.calls], "closed": s.closed})

    async def health(request: Any) -> Any:
        return JSONResponse(
            {"status": "ok", "model": name, "version": endpoint.version, "sessions": len(endpoint.sessions)}
        )

    routes = []
    for prefix in ("", "/s/{session}"):
        routes += [
            Route(f"{prefix}/v1/chat/completions", chat, methods=["POST"]),
            Route(f"{prefix}/v1/completions", completions, methods=["POST"]),
            Route(f"{prefix}/v1/models", models, methods=["GET"]),
        ]
    routes += [
        Route("/v1/sessions/{session}", session, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return json_app(routes, 8 * 2**20, error)
