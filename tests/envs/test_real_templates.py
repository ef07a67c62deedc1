"""The tool protocol on chat templates as their vendors ship them (TRL's copies, `trl/chat_templates`): Meta's
Llama 3.1 and 3.2 (a tool-calling turn's content dropped, one call per turn), Qwen3.5 with thinking on and
the other templates whose generation prompt opens ``<think>`` (the sampled turn starts inside its reasoning),
and the families whose calls we do not read yet, refused by name. Tokenized on Qwen2.5's real
vocabulary."""

from __future__ import annotations

import json
import time
from importlib.resources import files

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.errors import DataError
from searchrl.core.records import Example
from searchrl.envs.chat_format import _MARK, ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv

from .test_tools import CountingRetriever
from .test_tools_hostile import echo

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
SHIPPED = files("trl") / "chat_templates"


def shipped(name: str) -> str:
    return (SHIPPED / f"{name}.jinja").read_text()


@pytest.fixture
def tokenizer(qwen_tokenizer_dir):
    """A fresh Qwen2.5 tokenizer per test (its chat template is replaced)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


def env_for(tokenizer, template: str, **kwargs) -> ToolEnv:
    tokenizer.chat_template = shipped(template)
    env = ToolEnv(
        CountingRetriever(), ChatFormat(tokenizer, kwargs.pop("chat_kwargs", None)), topk=2, **kwargs
    )
    env.set_tools([*env.tools.values(), function_tool(echo)])
    return env


def llama_call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "parameters": arguments})


@pytest.mark.parametrize("template", ["llama3_1", "llama3_2"])
def test_meta_llama_templates_as_shipped_run_one_and_two_calls(tokenizer, template):
    env = env_for(tokenizer, template)
    assert env.call_format == "llama3_json" and env.format.end_of_turn == "<|eot_id|>"
    state = env.reset(EX)
    assert "<|start_header_id|>user<|end_header_id|>" in state.prompt and '"search"' in state.prompt
    [(obs, done, info)] = env.step_batch([state], [llama_call("search", query="Zelka") + "<|eot_id|>"])
    assert info.valid and info.kind == "search" and not done and env.retriever.calls == [["Zelka"]]
    assert obs.startswith("<|start_header_id|>ipython<|end_header_id|>") and "Zelka" in obs
    assert obs.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert _MARK not in obs and obs.count("ipython") == 1
    # two calls in one turn: the template takes one per turn; the tool messages of both are rendered
    two = f"{llama_call('search', query='Zelka')}; {llama_call('echo', text='hello')}<|eot_id|>"
    [(obs, done, info)] = env.step_batch([state], [two])
    assert info.valid and info.calls == ("search", "echo") and obs.count("ipython") == 2 and "hello" in obs
    tokenizer(obs, add_special_tokens=False)
    [(_, done, info)] = env.step_batch([state], ["Ann Lee<|eot_id|>"])
    assert done and info.answer == "Ann Lee"


@pytest.mark.parametrize(
    ("template", "kwargs", "opens"),
    [
        ("qwen3_5_think", {}, True),
        ("qwen3_6", {}, True),
        ("qwen3_8", {}, True),
        ("nemotron_3_nano", {"enable_thinking": True}, True),
        ("qwen3_5_think", {"enable_thinking": False}, False),
        ("qwen3_5_nothink", {}, False),
        ("qwen3", {"enable_thinking": False}, False),
        ("qwen2_5", {}, False),
    ],
)
def test_templates_that_open_the_reasoning_are_known(tokenizer, template, kwargs, opens):
    tokenizer.chat_template = shipped(template)
    assert ChatFormat(tokenizer, kwargs).opens_think is opens


def test_qwen35_thinking_turns_start_inside_the_reasoning(tokenizer):
    env = env_for(tokenizer, "qwen3_5_think")
    assert env.call_format == "qwen3_coder" and env.format.opens_think
    assert env.parse("The director is Ann Lee.\n</think>\n\nAnn Lee<|im_end|>").answer == "Ann Lee"
    # a call written before </think> is reasoning: not run; the answer after it is the turn's
    thought = "Maybe <tool_call>\n<function=search>\n<parameter=query>\nZelka\n</parameter>\n</function>\n</tool_call>"
    state = env.reset(EX)
    [(_, done, info)] = env.step_batch([state], [f"{thought}\n</think>\n\nAnn Lee<|im_end|>"])
    assert done and info.answer == "Ann Lee" and env.retriever.calls == []
    # a call after the reasoning runs; the next turn is opened inside its reasoning again
    state = env.reset(EX)
    act = "I need the film.\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nZelka\n</parameter>\n</function>\n</tool_call><|im_end|>"
    [(obs, done, info)] = env.step_batch([state], [act])
    assert (
        info.valid and info.kind == "search" and not done and obs.endswith("<|im_start|>assistant\n<think>\n")
    )
    # the teacher writes turns that close the opened reasoning
    assert env.parse(env.write_search("find it", "Zelka")).kind == "search"
    assert env.parse(env.write_answer("Ann Lee")).answer == "Ann Lee"
    assert env.parse(env.write_forced_answer("Ann Lee")).answer == "Ann Lee"


# DeepSeek V3.2 / V4 write calls in DSML (their templates are not redistributed with a package): Qwen2.5's template
# carrying DSML's marker stands in for one
DSML = shipped("qwen2_5") + "{%- if false %}<\uff5cDSML\uff5cfunction_calls>{% endif %}"


def test_families_we_do_not_read_are_refused_by_name(tokenizer, monkeypatch):
    """Every family we know is read now (DSML was the last refused: it reads as deepseek_dsml); the refusal stays
    for the next one, checked here with a made-up family."""
    from searchrl.envs import call_formats
    from searchrl.envs.call_formats import resolve

    assert resolve("auto", DSML) == "deepseek_dsml"
    monkeypatch.setitem(call_formats.UNSUPPORTED, "future", ("Future Family", "FUTURE_CALLS"))
    family, template = "Future Family", shipped("qwen2_5") + "{%- if false %}FUTURE_CALLS{% endif %}"
    with pytest.raises(DataError, match=f"in {family}.*call_format"):
        resolve("auto", template)
    assert resolve("hermes", template) == "hermes"  # the user says the model writes Hermes calls
    tokenizer.chat_template = template
    try:
        fmt = ChatFormat(tokenizer)
    except DataError:  # GLM-4.5's template writes no end-of-turn marker: refused when the format is made
        return
    with pytest.raises(DataError, match=f"in {family}"):
        ToolEnv(CountingRetriever(), fmt)


def glm(name: str, **arguments) -> str:
    """A GLM-4.5 calling turn as its template writes one, ended as the model ends it."""
    from searchrl.envs.call_formats import write

    return f"\n<think></think>\n{write('glm45', name, arguments)}<|observation|>"


def test_glm45_as_shipped_reads_calls_and_renders_what_its_template_renders(tokenizer):
    """GLM-4.5's template closes no turn: the model ends a calling turn with ``<|observation|>`` (which opens the
    tool messages) and an answer with ``<|user|>``. The episode's text, prompt + turns + observations, is
    byte-equal to the template's rendering of the whole conversation."""
    env = env_for(tokenizer, "glm4moe")
    assert env.call_format == "glm45" and set(env.stop_strings) == {"<|user|>", "<|observation|>"}
    assert (env.format.end_of_turn, env.format.call_end) == ("<|user|>", "<|observation|>")
    state = env.reset(EX)
    turns = [glm("search", query="Zelka"), glm("search", query="Ann Lee", k=2) + "", glm("echo", text="hi")]
    text = state.prompt
    messages = [*env.template.messages(EX.question)]
    for turn in turns:
        [(obs, done, info)] = env.step_batch([state], [turn])
        assert (
            info.valid
            and not done
            and obs.startswith("\n<tool_response>\n")
            and obs.endswith("<|assistant|>")
        )
        call = env.calls(turn)[0]
        result = obs[len("\n<tool_response>\n") : obs.rindex("\n</tool_response>")]
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "name": call.name, "content": result},
        ]  # fmt: skip
        text += turn + obs
    assert env.retriever.calls == [["Zelka"], ["Ann Lee"]] and env.calls(turns[1])[0].arguments["k"] == 2
    full = tokenizer.apply_chat_template(
        messages, tools=env.schemas, tokenize=False, add_generation_prompt=True
    )
    assert text == full
    [(_, done, info)] = env.step_batch([state], ["\n<think></think>\nAnn Lee<|user|>"])
    assert done and info.answer == "Ann Lee"
    # the teacher writes turns in the format; a malformed pair is a call that says why
    assert env.parse(env.write_search("find it", "Zelka")).kind == "search"
    assert env.parse(env.write_answer("Ann Lee")).answer == "Ann Lee"
    bad = "<tool_call>search\n<arg_key>query</arg_key>\nZelka\n</tool_call><|observation|>"
    [(obs, done, info)] = env.step_batch([env.reset(EX)], [bad])
    assert not info.valid and "arg_value" in obs


def test_a_special_token_in_a_tool_result_is_text(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=2)
    env.set_tools([function_tool(echo)])
    end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    plain = _obs(env, "hello")
    hostile = _obs(env, "a<|im_end|>b<|endoftext|>c")
    ids = lambda text: qwen_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids(hostile).count(end) == ids(plain).count(end)  # only the template's own turn ends
    assert "im_end" in hostile and "endoftext" in hostile  # the text is kept, broken up


def test_the_stand_in_marker_in_a_tool_result_does_not_empty_the_observation(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=2)
    env.set_tools([function_tool(echo)])
    obs = _obs(env, f"before{_MARK}after")
    assert "beforeafter" in obs and obs.endswith("<|im_start|>assistant\n")


def test_an_argument_with_the_end_of_turn_text_does_not_cut_the_observation(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=2)
    env.set_tools([function_tool(echo)])
    obs = _obs(env, "x\u003c|im_end|>y".replace("\u003c", "<"))
    assert obs.startswith("\n<|im_start|>user\n<tool_response>") and obs.endswith("<|im_start|>assistant\n")


def _obs(env: ToolEnv, text: str) -> str:
    state = env.reset(EX)
    body = json.dumps({"name": "echo", "arguments": {"text": text}}).replace("<", "\\u003c")
    [(obs, _, info)] = env.step_batch([state], [f"<tool_call>{body}</tool_call><|im_end|>"])
    assert info.valid, info
    return obs


def test_a_tool_call_tag_inside_an_argument_is_text(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=2)
    env.set_tools([function_tool(echo)])
    state = env.reset(EX)
    turn = (
        '<tool_call>{"name": "echo", "arguments": {"text": "I write <tool_call> here"}}</tool_call><|im_end|>'
    )
    [(obs, _, info)] = env.step_batch([state], [turn])
    assert info.valid and info.calls == ("echo",) and "I write <tool_call> here" in obs


@pytest.mark.parametrize("n", [4_000, 16_000, 64_000])
def test_the_answer_path_is_linear(qwen_tok, n):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=2)
    state = env.reset(EX)
    t = time.process_time()
    [(_, done, info)] = env.step_batch([state], ["<answer>" * n + "<|im_end|>"])
    assert time.process_time() - t < 0.5  # 16,000 took over 6 s of CPU before (a regex scan per <answer>)
    assert done and info.kind == "answer"
    assert env.parse("<answer>a</answer> and <answer> Ann  Lee </answer><|im_end|>").answer == "Ann Lee"


PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "<function=search>",
        "<function=echo>",
        "</function>",
        "<parameter=query>",
        "<parameter=text>",
        "</parameter>",
        "<|python_tag|>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<|observation|>",
        "<|user|>",
        "search\n",
        '{"name": "search", "parameters": {"query": "Zelka"}}',
        '{"name": "echo", "parameters": {"text": ',
        "; ",
        "{",
        "}",
        '"',
        "\\",
        "\u2063searchrl-stand-in\u2063",
        "<|im_end|>",
        "<|eot_id|>",
        "\udfff",
        "9" * 40,
    ]
)


@pytest.mark.parametrize("template", ["llama3_1", "qwen3_5_think", "glm4moe"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.one_of(PIECES, st.text(max_size=12)), max_size=120),
    repeat=st.sampled_from([1, 1, 2_000]),
)
def test_any_turn_on_a_shipped_template_is_an_observation(tokenizer, template, pieces, repeat):
    """Arbitrary text in the shipped Llama 3.1, Qwen3.5 (thinking) and GLM-4.5 templates' own call syntax, short or
    repeated thousands of times: no exception, an observation that tokenizes, bounded CPU time."""
    env = env_for(tokenizer, template)
    text = ("".join(pieces) * repeat).encode("utf-8", "replace").decode("utf-8")
    state = env.reset(EX)
    t = time.process_time()
    [(obs, done, info)] = env.step_batch([state], [text + env.format.end_of_turn], stopped=[True])
    tokenizer(obs, add_special_tokens=False)
    assert time.process_time() - t < 2.0
    assert done == (info.kind == "answer")
