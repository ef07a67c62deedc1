"""Whatever a policy writes in the tool protocol is an observation, never an exception, in time linear in the
turn's length (issue 48): each hostile case becomes a tool message the model reads, the turn counts as
invalid, and the observation tokenizes on Qwen2.5's real vocabulary."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tools import parse_tool_calls

from .test_tools import CountingRetriever, call

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
    """
    return text


def steps_safely(env, example, pieces: list[str], end: str) -> None:
    """Whatever a policy writes (``pieces`` joined, then ``end``) steps without raising: calls that run or say why;
    the observation tokenizes; the episode ends exactly on an answer (the families' hostile property tests)."""
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    state = env.reset(example)
    [(obs, done, info)] = env.step_batch([state], [text + end], stopped=[True])
    env.format.tokenizer(obs, add_special_tokens=False)
    assert done == (info.kind == "answer")


@pytest.fixture
def env(qwen_tok):
    e = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools", topk=2, max_turns=3)
    e.set_tools([*e.tools.values(), function_tool(echo)])
    return e


def step(env, qwen_tok, text):
    """One turn: the observation, its info, and its ids (the observation must tokenize)."""
    state = env.reset(EX)
    [(obs, _done, info)] = env.step_batch([state], [text + "<|im_end|>"], stopped=[True])
    ids = qwen_tok(obs, add_special_tokens=False)["input_ids"]
    return obs, info, ids


def test_deep_nesting_is_a_message(env, qwen_tok):
    deep = (
        '<tool_call>{"name":"search","arguments":{"query":"a","k":' + "[" * 990 + "]" * 990 + "}}</tool_call>"
    )
    obs, info, _ = step(env, qwen_tok, deep)
    assert not info.valid and info.error in ("malformed_json", "bad_arguments") and "Error:" in obs


def test_an_integer_past_pythons_digit_limit_is_a_message(env, qwen_tok):
    huge = '<tool_call>{"name":"search","arguments":{"query":"a","k":' + "9" * 4301 + "}}</tool_call>"
    obs, info, _ = step(env, qwen_tok, huge)
    assert not info.valid and info.error == "malformed_json" and "cannot be read" in obs


def test_an_unpaired_surrogate_never_reaches_a_tool_or_the_tokenizer(env, qwen_tok):
    text = '<tool_call>{"name": "echo", "arguments": {"text": "a\\udfffb"}}</tool_call>'
    obs, info, ids = step(env, qwen_tok, text)
    assert not info.valid and info.error == "malformed_json" and "surrogate" in obs and ids

    def broken(text: str) -> str:
        """Return text that is not valid Unicode.

        Args:
            text: ignored
        """
        return "x\udfffy"

    env.set_tools([function_tool(broken)])
    obs, info, ids = step(env, qwen_tok, call("broken", text="a"))
    assert info.valid and "x?y" in obs and ids  # a tool's own output: replaced in the observation


@pytest.mark.parametrize("n", [8_192, 32_768])
def test_many_unclosed_calls_parse_in_linear_time(env, qwen_tok, n):
    t = time.perf_counter()
    _obs, info, _ = step(env, qwen_tok, "<tool_call>" * n)
    assert time.perf_counter() - t < 5.0  # 32,768 took over 30 s before (a quadratic scan)
    assert info.error == "unclosed_tool_call" and not info.valid


def test_a_thousand_calls_get_one_message_past_the_cap(env, qwen_tok):
    obs, info, ids = step(env, qwen_tok, call("search", query="Zelka") * 1000)
    assert info.error == "too_many_calls" and obs.count("<tool_response>") == env.max_tool_calls + 1
    assert "996 more tool calls not run" in obs and len(ids) < 2_000  # was ~15k tokens of messages


def test_a_call_inside_reasoning_is_not_run(env, qwen_tok):
    text = f"<think> maybe {call('search', query='Zelka')} no </think>Ann Lee"
    state = env.reset(EX)
    [(_obs, done, info)] = env.step_batch([state], [text + "<|im_end|>"])
    assert done and info.kind == "answer" and info.answer == "Ann Lee" and env.retriever.calls == []


def test_duplicate_keys_are_refused_not_resolved(env, qwen_tok):
    text = '<tool_call>{"name": "search", "name": "echo", "arguments": {"query": "a"}}</tool_call>'
    obs, info, _ = step(env, qwen_tok, text)
    assert info.error == "duplicate_key" and "'name' appears twice" in obs and env.retriever.calls == []


def test_max_query_chars_applies_to_tool_queries(env, qwen_tok):
    env.max_query_chars = 20
    obs, info, _ = step(env, qwen_tok, call("search", query="x " * 50))
    assert info.error == "query_too_long" and "at most 20" in obs and env.retriever.calls == []


@pytest.mark.parametrize("side", ["right", "left", "middle"])
def test_tool_responses_are_capped_on_the_chosen_side(qwen_tok, side):
    e = ToolEnv(
        CountingRetriever(), ChatFormat(qwen_tok), template="tools", max_response_chars=30, truncate_side=side
    )
    text = "A" * 20 + "M" * 60 + "Z" * 20
    out = e.cap(text)
    assert "[70 characters cut]" in out and len(out.replace(" …[70 characters cut] ", "")) == 30
    kept = out.replace(" …[70 characters cut] ", "")
    assert {
        "right": kept.startswith("A" * 20),
        "left": kept.endswith("Z" * 20),
        "middle": kept[:15] == "A" * 15,
    }[side]
    e.set_tools([function_tool(echo)])
    obs, _, _ = step(e, qwen_tok, call("echo", text=text))
    assert "[70 characters cut]" in obs


def test_parse_never_raises_on_these():
    from searchrl.envs.tools import search_tool

    tools = {"search": search_tool(CountingRetriever(), 2, lambda d: "")}
    for body in (
        "",
        "null",
        "[]",
        '"x"',
        "1e999999",
        "NaN",
        '{"name": 1}',
        '{"name": "search", "arguments": "[1"}',
    ):
        [c] = parse_tool_calls(f"<tool_call>{body}</tool_call>", tools)
        assert not c.valid and c.detail


JSONISH = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "{",
        "}",
        "[",
        "]",
        '"',
        ":",
        ",",
        "\\",
        "\\udfff",
        '"name"',
        '"search"',
        '"echo"',
        '"arguments"',
        '"query"',
        '"text"',
        "9" * 50,
        "\x00",
        "\x1b",
        "\udfff",
        "é",
        "𝔸",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(JSONISH, st.text(max_size=20)), max_size=200))
def test_any_text_is_an_observation(env, qwen_tok, pieces):
    """Arbitrary text (tags, JSON fragments, escapes, surrogates, control characters) through parsing,
    `step_batch` and tokenization: no exception, a bounded time, one observation that tokenizes."""
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")  # what a tokenizer's decode can give
    t = time.perf_counter()
    state = env.reset(EX)
    [(obs, done, info)] = env.step_batch([state], [text + "<|im_end|>"], stopped=[True])
    qwen_tok(obs, add_special_tokens=False)
    assert time.perf_counter() - t < 2.0
    assert done == (info.kind == "answer")


@settings(max_examples=60, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
        max_leaves=30,
    )
)
def test_any_json_arguments_are_checked_not_raised(args):
    from searchrl.envs.tools import search_tool

    tools = {"search": search_tool(CountingRetriever(), 2, lambda d: ""), "echo": function_tool(echo)}
    body = json.dumps({"name": "search", "arguments": args})
    [c] = parse_tool_calls(f"<tool_call>{body}</tool_call>", tools)
    assert c.valid == (
        isinstance(args, dict)
        and isinstance(args.get("query"), str)
        and set(args) <= {"query", "k"}
        and (not isinstance(args.get("k", 0), bool) and isinstance(args.get("k", 0), int))
    )
