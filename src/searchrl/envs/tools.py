"""Tools an agent calls in its model's own chat format: OpenAI function schemas, each backed by a batched
Python function; parsing the ``<tool_call>`` blocks a Qwen-style model writes.

A `Tool` has a name, a description, a JSON schema of its arguments (an OpenAI function schema once wrapped
by `Tool.schema`) and ``run``, which takes a batch of calls (arguments and the episode that made each) and
returns one `ToolResult` each: the text the model reads back, and the documents it showed (so that rewards
and metrics see what a call retrieved). Searches from every episode of an environment step go to the
retriever in one batch. Built in: ``search`` (any retriever) and ``open`` (a document's full text). The
tools users bring (functions, ``async def``, stateful classes) are `searchrl.envs.python_tools`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from searchrl.core.records import Doc
from searchrl.core.types import EnvState

# JSON schema types -> the Python types a value of it may have (bool is not an integer here)
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
# why a tool call could not be run (StepInfo.error of its action)
CALL_ERRORS = (
    "unclosed_tool_call",
    "malformed_json",
    "duplicate_key",
    "missing_name",
    "unknown_tool",
    "bad_arguments",
    "too_many_calls",
)
# why a call that ran gave no answer (ToolResult.error): the tool's failures, not the model's; each kind counted
# in the rollout metrics as ``tool/<name>_rate`` per call run, all of them as ``tool/error_rate``
# (`searchrl.rollout.episode`)
TOOL_FAILURES = {
    "tool_error": "raised",
    "tool_timeout": "timeout",
    "non_text_result": "non_text",
    "unknown_doc": "unknown_doc",
    "empty_query": "empty_query",
}


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads in the tool message
    docs: tuple[Doc, ...] = ()  # documents the call showed (search results, an opened document)
    error: str | None = None  # the call failed: ``text`` says why to the model


@dataclass(frozen=True)
class ToolCall:
    """One parsed ``<tool_call>`` block: the tool and its arguments, or why it cannot be run."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # one of `CALL_ERRORS`
    detail: str = ""  # what was wrong, told to the model
    id: str | None = None  # the id the model gave the call (Mistral writes one; its result names it)

    @property
    def valid(self) -> bool:
        return self.error is None


Runner = Callable[[list[tuple[dict[str, Any], EnvState]]], list[ToolResult]]


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[
        str, Any
    ]  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}
    run: Runner  # a batch of (arguments, episode state) -> one result each
    # per-episode objects the tool runs on (`envs.python_tools.ToolObjects`): started when an episode starts
    owner: Any = field(default=None, compare=False, repr=False)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema a chat template renders (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check(self, arguments: dict[str, Any]) -> str | None:
        """Why ``arguments`` do not fit the schema (a missing or unknown argument, a wrong type), or None.
        Only the top level is checked, as function-calling servers do before dispatch."""
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing required argument {missing[0]!r}"
        for key, value in arguments.items():
            if key not in props:
                return f"unknown argument {key!r}; {self.name} takes {', '.join(props) or 'no arguments'}"
            kind = props[key].get("type")
            kinds = kind if isinstance(kind, list) else [kind] if kind else []
            ok = not kinds or any(
                isinstance(value, _TYPES.get(k, object))
                and not (k in ("integer", "number") and isinstance(value, bool))
                and not (k == "number" and isinstance(value, float) and not math.isfinite(value))
                for k in kinds
            )
            if not ok:
                return f"argument {key!r} must be {' or '.join(kinds)}, got {json.dumps(value)}"
        return None


def format_tool_docs(docs: Sequence[Doc], max_words: int | None = None) -> str:
    """Search results as the tool protocol shows them, one per line, with the id ``open`` takes."""
    lines = []
    for i, d in enumerate(docs, 1):
        text = d.text if max_words is None else " ".join(d.text.split()[:max_words])
        lines.append(f"Doc {i} [{d.id}](Title: {d.title}) {text}")
    return "\n".join(lines)


def search_tool(
    retriever: Any, topk: int, format_docs: Callable[[Sequence[Doc]], str], max_k: int = 10
) -> Tool:
    """``search(query, k)`` over any retriever, batched across the calls of one environment step."""

    def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
        queries = [" ".join(str(a["query"]).split()) for a, _ in calls]
        ks = [max(1, min(int(a.get("k", topk)), max_k)) for a, _ in calls]
        out: list[ToolResult] = [ToolResult("", error="empty_query")] * len(calls)
        for k in sorted(set(ks)):  # one batched retrieval per distinct k
            idx = [i for i, (q, kk) in enumerate(zip(queries, ks)) if kk == k and q]
            for i, docs in zip(idx, retriever.search([queries[i] for i in idx], k) if idx else []):
                out[i] = ToolResult(format_docs(docs), tuple(docs))
        return [
            r if r.error is None else ToolResult("Error: the query is empty.", error=r.error) for r in out
        ]

    return Tool(
        "search",
        "Search the knowledge base. Returns the top documents for the query, each with its id and title.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what to search for"},
                "k": {
                    "type": "integer",
                    "description": f"how many documents (default {topk}, at most {max_k})",
                },
            },
            "required": ["query"],
        },
        run,
    )


def open_tool(max_words: int | None = None) -> Tool:
    """``open(doc_id)``: the full text of a document this episode's searches returned (search results may
    be cut to ``env.doc_max_words``; opening reads the rest)."""

    def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
        out = []
        for args, state in calls:
            doc_id = str(args["doc_id"])
            seen = {d.id: d for docs in state.retrieved for d in docs}
            doc = seen.get(doc_id)
            if doc is None:
                out.append(
                    ToolResult(
                        f"Error: no document {doc_id!r} among this episode's search results.",
                        error="unknown_doc",
                    )
                )
                continue
            words = doc.text.split()
            text = " ".join(words[:max_words]) if max_words else doc.text
            out.append(ToolResult(f"(Title: {doc.title}) {text}", (doc,)))
        return out

    return Tool(
        "open",
        "Read the full text of a document returned by an earlier search, by its id.",
        {
            "type": "object",
            "properties": {"doc_id": {"type": "string", "description": "the id shown in the search results"}},
            "required": ["doc_id"],
        },
        run,
    )


OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(
    text: str,
    tools: dict[str, Tool],
    limit: int | None = None,
    one: Callable[[str, dict[str, Tool]], ToolCall] | None = None,
    markers: tuple[str, str] = (OPEN, CLOSE),
) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text``, in order, each
    checked against its tool's schema. ``arguments`` may also be a JSON string of an object (some models
    write it so). A ``<tool_call>`` left open is one more, invalid, call. With ``limit``, the blocks past the
    first ``limit`` are not parsed: one ``too_many_calls`` call stands for all of them (a turn of 1,000 calls
    reads one message, not 1,000).

    Whatever the model wrote, this returns: malformed, deeply nested or duplicate-keyed JSON, integers past
    Python's 4,300-digit limit and unpaired surrogates are calls that cannot run, each saying why; the scan
    finds each block with one forward search for its close, so it is linear in the text's length. ``one``
    reads a block's body (default: the JSON call; `envs.call_formats` passes the XML one), and ``markers`` are the
    block's open and close (DeepSeek's are control tokens)."""
    one = one or _one_call
    opening, closing = markers
    calls: list[ToolCall] = []
    extra = pos = 0
    unclosed = False
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            unclosed = True  # a block left open (one inside a closed block's arguments is its text)
            break
        if limit is None or len(calls) < limit:
            calls.append(one(text[start + len(opening) : end], tools))
        else:
            extra += 1
        pos = end + len(closing)
    if extra:
        calls.append(
            ToolCall(
                None,
                error="too_many_calls",
                detail=f"{extra} more tool call{'s' if extra > 1 else ''} not run: at most {limit} per turn",
            )
        )
    if unclosed:
        calls.append(ToolCall(None, error="unclosed_tool_call", detail=f"a {opening} was not closed"))
    return calls


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _loads(body: str) -> tuple[Any, ToolCall | None]:
    """``body`` as JSON, or the call that says why it is not: a duplicate key is refused, not resolved (a
    second ``"name"`` would silently switch tools), and text must be text (no unpaired surrogate, which no
    encoder can send on)."""
    try:
        obj = json.loads(body, object_pairs_hook=_no_duplicates)
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except _DuplicateKey as exc:
        detail = f"the key {str(exc)[:80]!r} appears twice in one object; write each key once"
        return None, ToolCall(None, error="duplicate_key", detail=detail)
    except json.JSONDecodeError as exc:
        return None, ToolCall(
            None, error="malformed_json", detail=f"the tool call is not valid JSON ({exc.msg})"
        )
    except RecursionError:
        return None, ToolCall(
            None, error="malformed_json", detail="the tool call's JSON is nested too deeply"
        )
    except UnicodeEncodeError:
        detail = "the tool call's strings hold an unpaired surrogate (\\ud800-\\udfff), which is not text"
        return None, ToolCall(None, error="malformed_json", detail=detail)
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        return None, ToolCall(
            None, error="malformed_json", detail=f"the tool call's JSON cannot be read ({exc})"[:200]
        )
    return obj, None


def _one_call(body: str, tools: dict[str, Tool]) -> ToolCall:
    obj, bad = _loads(body)
    if bad is not None:
        return bad
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error="missing_name", detail='a tool call is {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):
        inner, bad = _loads(args)
        if bad is None:
            args = inner
    if name not in tools:
        shown = name if len(name) <= 80 else name[:80] + "…"
        return ToolCall(shown, error="unknown_tool", detail=f"no tool {shown!r}; tools: {', '.join(tools)}")
    if not isinstance(args, dict):
        return ToolCall(name, error="bad_arguments", detail="arguments must be a JSON object")
    problem = tools[name].check(args)
    if problem is not None:
        return ToolCall(name, args, error="bad_arguments", detail=problem[:300])
    return ToolCall(name, args)
