"""The call formats of the families users train (`searchrl.envs.call_formats`), on Qwen2.5's real vocabulary:
each family's template renders a call, our parser reads it back equal, the environment's turns are the
template's own text appended after what was sampled, and arbitrary text never raises."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs import call_formats
from searchrl.envs.call_formats import LLAMA3_JSON_TEMPLATE, QWEN3_CODER_TEMPLATE
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.tool_env import ToolEnv
from searchrl.models.qwen import CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE

from .test_tools import CountingRetriever

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
TEMPLATES = {
    "hermes": CHAT_TEMPLATE,
    "qwen3_coder": QWEN3_CODER_TEMPLATE,
    "llama3_json": LLAMA3_JSON_TEMPLATE,
}


_FORMATS: dict = {}


def fmt_for(qwen_tok, template):
    """Qwen2.5's vocabulary with ``template`` (one copy per template: copying the tokenizer is slow)."""
    if template not in _FORMATS:
        tok = copy.deepcopy(qwen_tok)
        tok.chat_template = template
        _FORMATS[template] = ChatFormat(tok)
    return _FORMATS[template]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_format_is_read_from_the_template(name):
    assert call_formats.detect(TEMPLATES[name]) == name
    assert call_formats.detect(QWEN3_CHAT_TEMPLATE) == "hermes"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_rendered_call_reads_back_equal_and_the_episode_appends(qwen_tok, name):
    fmt = fmt_for(qwen_tok, TEMPLATES[name])
    env = ToolEnv(CountingRetriever(), fmt, template="tools", topk=2, max_turns=3)
    assert env.call_format == name
    state = env.reset(EX)
    args = {"query": "Zelka director", "k": 2}
    messages = env.template.messages(EX.question)
    call = {"type": "function", "function": {"name": "search", "arguments": args}}
    rendered = fmt.render(
        [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}], env.schemas, opened=False
    )
    assert rendered.startswith(state.prompt)
    turn = rendered[len(state.prompt) :]
    turn = turn[: turn.index(fmt.end_of_turn)]
    [parsed] = env.calls(turn + fmt.end_of_turn)
    assert parsed.valid and parsed.name == "search" and parsed.arguments == args
    # what the teacher writes parses the same way
    [written] = env.calls(env.write_search("look it up", "Zelka director"))
    assert written.valid and written.arguments == {"query": "Zelka director"}
    # an episode: the model's turn, then the tool message the template writes, appended
    action = turn + fmt.end_of_turn
    obs, done, info = env.step(state, action, stopped=True)
    assert not done and info.valid and info.kind == "search"
    result = obs  # the template's text after the call turn, ending with the next assistant turn opened
    whole = fmt.render(
        [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "search", "content": "X"},
        ],
        env.schemas,
    )
    prefix = state.prompt + action
    assert whole.startswith(prefix.rstrip(fmt.end_of_turn)) and whole.endswith(result[-20:])
    ids = qwen_tok(state.prompt + action + obs, add_special_tokens=False)["input_ids"]
    assert ids and qwen_tok.decode(ids) == state.prompt + action + obs


def test_qwen3_coder_values_are_typed_by_the_schema(qwen_tok):
    env = ToolEnv(CountingRetriever(), fmt_for(qwen_tok, QWEN3_CODER_TEMPLATE), template="tools")
    text = "<tool_call>\n<function=search>\n<parameter=query>\nwho is\nAnn Lee\n</parameter>\n<parameter=k>\n3\n</parameter>\n</function>\n</tool_call>"
    [c] = env.calls(text)
    assert c.valid and c.arguments == {"query": "who is\nAnn Lee", "k": 3}
    [bad] = env.calls(text.replace("\n3\n", "\nthree\n"))
    assert not bad.valid and bad.error == "bad_arguments" and "integer" in bad.detail
    [dup] = env.calls(text.replace("<parameter=k>", "<parameter=query>"))
    assert dup.error == "duplicate_key"
    [unknown] = env.calls(text.replace("function=search", "function=browse"))
    assert unknown.error == "unknown_tool"


def test_llama_json_calls_answers_and_malformed_turns(qwen_tok):
    env = ToolEnv(CountingRetriever(), fmt_for(qwen_tok, LLAMA3_JSON_TEMPLATE), template="tools")
    two = '{"name": "search", "parameters": {"query": "a"}}; {"name": "search", "parameters": {"query": "b"}}'
    assert [c.arguments["query"] for c in env.calls(two)] == ["a", "b"]
    assert [
        c.arguments for c in env.calls('<|python_tag|>{"name": "search", "parameters": {"query": "c"}}')
    ] == [{"query": "c"}]
    assert env.calls("Ann Lee") == []  # the final answer
    state = env.reset(EX)
    _, done, info = env.step(state, "Ann Lee<|eot_id|>", stopped=True)
    assert done and info.answer == "Ann Lee"
    [bad] = env.calls('{"name": "search", "parameters": {"query": ')
    assert bad.error == "malformed_json"
    [dup] = env.calls('{"name": "search", "name": "open", "parameters": {"query": "a"}}')
    assert dup.error == "duplicate_key"
    many = env.calls("; ".join(['{"name": "search", "parameters": {"query": "x"}}'] * 9))
    assert len(many) == env.max_tool_calls + 1 and many[-1].error == "too_many_calls"


PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<function=search>",
        "<function=",
        "</function>",
        "<parameter=query>",
        "<parameter=k>",
        "</parameter>",
        "{",
        "}",
        "[",
        '"name": "search"',
        '"parameters": {',
        ";",
        "\n",
        "9" * 40,
        "\udfff",
        "<|python_tag|>",
        '"query": "',
        "é",
    ]
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(["qwen3_coder", "llama3_json"]),
    st.lists(st.one_of(PIECES, st.text(max_size=10)), max_size=120),
)
def test_any_text_is_calls_or_an_answer(qwen_tok, name, pieces):
    env = ToolEnv(CountingRetriever(), fmt_for(qwen_tok, TEMPLATES[name]), template="tools")
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    state = env.reset(EX)
    [(obs, done, info)] = env.step_batch([state], [text + env.format.end_of_turn], stopped=[True])
    qwen_tok(obs, add_special_tokens=False)
    assert done == (info.kind == "answer")


@pytest.mark.parametrize("name", call_formats.FORMATS)
def test_the_tools_description_shows_each_formats_call(name):
    """What a template that renders no schemas gets in its system prompt: each tool, and a call in the format."""
    schema = {"type": "function", "function": {"name": "search", "description": "Find it.", "parameters": {"type": "object"}}}  # fmt: skip
    text = call_formats.describe(name, [schema])
    assert text.startswith("## Tools\n") and "### search\nDescription: Find it.\n" in text
    assert 'Parameters: {"type": "object"}' in text and "tool_call_name" in text
    marker = {"hermes": "<tool_call>", "glm45": "<tool_call>", "qwen3_coder": "<function=", "mistral": "[TOOL_CALLS]",
              "llama3_json": '"parameters"', "gemma4": "<|tool_call>call:", "gemma3": "```tool_code\n", "gpt_oss": "to=functions.", "deepseek_dsml": call_formats.DSML_CALLS}.get(name, call_formats.DS_CALLS)  # fmt: skip
    assert marker in text
