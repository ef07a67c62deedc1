"""DeepSeek-V3.2's DSML tool calls (``env.call_format: deepseek_dsml``). DeepSeek ships no chat template for V3.2,
only its Python reference encoder; `searchrl.models.deepseek.V32_TEMPLATE` is a Jinja port of it, checked here
against that encoder (SGLang's copy, tests/fixtures/deepseek_v32) on generated conversations in both of its modes;
an episode over two tool rounds equals the encoder's rendering of the conversation; calls round-trip, malformed
ones say why, and any turn is calls that run or say why; the example `openai`-client agent trains through the
endpoint on one row whose ids are the tokenized rendering. On DeepSeek-V3's vocabulary (V3.2's own is not on a
package registry: DSML's markup is text in either)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs import call_formats
from searchrl.envs.call_formats import DSML, DSML_CALLS, DSML_CALLS_END, DSML_INVOKE, DSML_INVOKE_END
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tools import Tool
from searchrl.models.deepseek import V32_TEMPLATE

from .test_tools import CountingRetriever
from .test_tools_hostile import echo, steps_safely

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
RESULTS, RESULTS_END = "\n\n<function_results>", "\n</function_results>\n\n</think>"


def _encoder():
    path = Path(__file__).parents[1] / "fixtures" / "deepseek_v32" / "encoding_dsv32.py"
    spec = importlib.util.spec_from_file_location("encoding_dsv32", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENC = _encoder()


@pytest.fixture(scope="module")
def tok():
    from searchrl.models.deepseek import deepseek_tokenizer

    return deepseek_tokenizer(template="v3.2")


def reference(messages, tools=None, mode="chat"):
    """The encoder's rendering: tools on the system message (one made with empty content if none), arguments as
    the JSON text OpenAI messages carry."""
    msgs = copy.deepcopy(messages)
    if tools:
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["tools"] = tools
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    for m in msgs:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    return ENC.encode_messages(msgs, thinking_mode=mode)


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


SEARCH = {"type": "function", "function": {"name": "search", "description": "Search — the corpus.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}  # fmt: skip
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), VALUES, max_size=4)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)


@st.composite
def conversations(draw):
    """A system prompt or none, a user turn, rounds of calls (one or several) each followed by its results, an
    answer or not, and sometimes a second user turn; reasoning on every assistant turn (the thinking mode renders
    it after the last user turn)."""
    out = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    out.append({"role": "user", "content": draw(TEXT)})
    for _ in range(draw(st.integers(0, 3))):
        calls = [
            call(draw(st.sampled_from(["search", "open"])), draw(ARGS))
            for _ in range(draw(st.integers(1, 3)))
        ]
        out.append(
            {"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT), "tool_calls": calls}
        )
        out += [{"role": "tool", "content": draw(TEXT)} for _ in calls]
    if draw(st.booleans()):
        out.append({"role": "assistant", "content": draw(TEXT), "reasoning_content": draw(TEXT)})
        if draw(st.booleans()):
            out.append({"role": "user", "content": draw(TEXT)})
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations(), st.booleans(), st.sampled_from(["chat", "thinking"]))
def test_the_template_renders_what_deepseeks_encoder_renders(tok, messages, with_tools, mode):
    tools = [SEARCH] if with_tools else None
    try:
        want = reference(messages, tools, mode)
    except (
        ENC.DS32EncodingError
    ):  # the encoder refuses (thinking: an answer without reasoning); nothing to match
        return
    got = tok.apply_chat_template(messages, tools=tools, tokenize=False, thinking=mode == "thinking")
    assert got == want


def test_the_format_is_read_from_the_template(tok):
    assert call_formats.detect(tok.chat_template) == "deepseek_dsml"
    assert (
        call_formats.resolve("auto", "{{ '<\uff5cDSML\uff5ctool_calls>' }}") == "deepseek_dsml"
    )  # V4's wrapper
    fmt = ChatFormat(tok)
    assert fmt.call_format == "deepseek_dsml" and fmt.renders_tools and fmt.ends == (EOS,)
    assert not fmt.opens_think


def env_for(tokenizer) -> ToolEnv:
    env = ToolEnv(CountingRetriever(), ChatFormat(tokenizer), topk=2)
    env.set_tools([*env.tools.values(), function_tool(echo)])
    return env


def test_an_episode_over_two_rounds_is_the_encoders_rendering(tok):
    """Two calls in one turn, then one, then the answer: the episode's text (prompt, sampled turns, observations)
    equals DeepSeek's encoder on the conversation, the tools in the system prompt."""
    env = env_for(tok)
    assert env.call_format == "deepseek_dsml"
    state = env.reset(EX)
    assert state.prompt.endswith("<\uff5cAssistant\uff5c></think>") and "<functions>" in state.prompt
    text, messages = state.prompt, [*env.template.messages(EX.question)]
    rounds = [
        [("search", {"query": "Zelka", "k": 2}), ("echo", {"text": "hi"})],
        [("search", {"query": "Ann Lee"})],
    ]
    for k, calls in enumerate(rounds):
        content = "Looking it up." if k == 0 else ""
        invokes = "\n".join(call_formats.dsml_invoke(n, a) for n, a in calls)
        turn = f"{content}\n\n{DSML_CALLS}\n{invokes}\n{DSML_CALLS_END}{EOS}"
        [(obs, done, info)] = env.step_batch([state], [turn])
        assert info.valid and info.calls == tuple(n for n, _ in calls) and not done
        assert obs.startswith(RESULTS) and obs.endswith(RESULTS_END) and obs.count("<result>") == len(calls)
        results = [r.split("</result>")[0] for r in obs.split("<result>")[1:]]
        messages.append(
            {"role": "assistant", "content": content, "tool_calls": [call(n, a) for n, a in calls]}
        )
        messages += [{"role": "tool", "content": r} for r in results]
        text += turn + obs
    [(_, done, info)] = env.step_batch([state], [f"Ann Lee{EOS}"])
    assert done and info.answer == "Ann Lee" and env.retriever.calls == [["Zelka"], ["Ann Lee"]]
    messages.append({"role": "assistant", "content": "Ann Lee"})
    assert text + f"Ann Lee{EOS}" == reference(messages, env.schemas)


@settings(max_examples=150, deadline=None)
@given(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), ARGS)
def test_write_and_parse_round_trip(name, args):
    args = {k: v for k, v in args.items() if not (isinstance(v, str) and DSML in v)}
    tool = Tool(name, "", {"type": "object", "properties": {k: {} for k in args}}, run=lambda **kw: "")
    [parsed] = call_formats.parse(
        "deepseek_dsml", call_formats.write("deepseek_dsml", name, args), {name: tool}
    )
    assert parsed.error is None and parsed.name == name and parsed.arguments == args


P = f'{DSML_INVOKE} name="echo">\n'


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (f"{DSML_INVOKE}>\n{DSML_INVOKE_END}", "missing_name"),
        (
            f'{P}<{DSML}parameter name="text" string="false">{{oops</{DSML}parameter>\n{DSML_INVOKE_END}',
            "malformed_json",
        ),
        (f'{P}<{DSML}parameter name="text">hi</{DSML}parameter>\n{DSML_INVOKE_END}', "bad_arguments"),
        (f'{P}<{DSML}parameter name="text" string="true">hi\n{DSML_INVOKE_END}', "bad_arguments"),
        (
            f'{P}<{DSML}parameter name="text" string="true">a</{DSML}parameter>\n'
            f'<{DSML}parameter name="text" string="true">b</{DSML}parameter>\n{DSML_INVOKE_END}',
            "duplicate_key",
        ),
        (f'{DSML_INVOKE} name="nope">\n{DSML_INVOKE_END}', "unknown_tool"),
        (f'{P}<{DSML}parameter name="text" string="true">hi</{DSML}parameter>', "unclosed_tool_call"),
    ],
)
def test_malformed_calls_say_why(body, error):
    calls = call_formats.parse("deepseek_dsml", f"\n\n{DSML_CALLS}\n{body}", {"echo": function_tool(echo)})
    assert calls and calls[0].error == error, calls


def test_a_parameter_that_never_closes_is_read_in_linear_time():
    body = P + f'<{DSML}parameter name="text" string="true">x' * 20_000 + DSML_INVOKE_END
    [c] = call_formats.parse("deepseek_dsml", body, {"echo": function_tool(echo)})
    assert c.error == "bad_arguments"


PIECES = st.sampled_from(
    [DSML_CALLS, DSML_CALLS_END, DSML_INVOKE, DSML_INVOKE_END, ' name="search">', ' name="echo">', "\n",
     f'<{DSML}parameter name="query" string="true">', f'<{DSML}parameter name="text" string="false">',
     f"</{DSML}parameter>", "Zelka", '"hi"', "{", "}", "</think>", "<think>", EOS, "<result>", "\u00e9"]
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=80))
def test_any_turn_is_calls_that_run_or_say_why(tok, pieces):
    steps_safely(env_for(tok), EX, pieces, EOS)


def test_searchrl_tokenizer_writes_deepseek_v32(tmp_path):
    from transformers import AutoTokenizer

    from searchrl.app.cli import main

    main(["tokenizer", "deepseek-v3.2", "--out", str(tmp_path)])
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (
        tok.chat_template == V32_TEMPLATE.read_text()
        and call_formats.detect(tok.chat_template) == "deepseek_dsml"
    )


def dsml_turns(prompt: str) -> str:
    """Search twice, then answer, as DeepSeek-V3.2 writes it (the end of sentence is the endpoint's stop)."""
    n = prompt.count("<result>")  # (the tools' description shows a <function_results> block)
    if n >= 2:
        return "Ann Lee"
    return call_formats.write("deepseek_dsml", "search", {"query": ["Zelka director", "Ann Lee"][n]})


def test_an_openai_client_agent_on_deepseek_v32_trains_on_the_encoders_ids(tok, monkeypatch):
    """The example agent through the policy endpoint on V3.2's format: its two tool rounds extend one row, whose
    ids are the tokenized rendering of the whole conversation by DeepSeek's encoder."""
    from ..rollout.test_agent_program import example_agent_episode

    t, messages, tools = example_agent_episode(tok, dsml_turns, monkeypatch, end=EOS, contents=("", ""))
    whole = reference(messages, tools)
    assert "<functions>" in whole and t.token_ids == tok(whole, add_special_tokens=False)["input_ids"]


def test_a_model_directory_without_a_template_takes_the_stored_one(tmp_path):
    """DeepSeek-V3.2's model directories hold no chat template: the tool protocol says what to do, and the stored
    template copied in as chat_template.jinja is the one transformers loads."""
    import shutil

    from transformers import AutoTokenizer

    from searchrl.core.errors import DataError
    from searchrl.models.deepseek import deepseek_tokenizer

    bare = deepseek_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(DataError, match="deepseek_v32.jinja"):
        ChatFormat(AutoTokenizer.from_pretrained(str(tmp_path)))
    shutil.copy(V32_TEMPLATE, tmp_path / "chat_template.jinja")
    fmt = ChatFormat(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert fmt.call_format == "deepseek_dsml"
