"""The tool protocol on Qwen2.5's and Qwen3's real vocabularies: tool schemas, `<tool_call>` parsing, the
environment's turns and tool messages, built-in and Python-function tools."""

from __future__ import annotations

import json

import pytest

from searchrl.core.records import Doc, Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import BUDGET_NOTE, ToolEnv
from searchrl.envs.tools import open_tool, parse_tool_calls, search_tool

DOCS = [
    Doc("d1", "Paris", "Paris is the capital of France. " + "It is large. " * 20),
    Doc("d2", "Lyon", "Lyon is a city in France."),
    Doc("d3", "Zelka", "Zelka was directed by Ann Lee."),
]


class CountingRetriever:
    """Word-overlap retrieval over `DOCS`, counting its batched calls."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def search(self, queries, k):
        self.calls.append(list(queries))
        score = lambda q, d: len(set(q.lower().split()) & set((d.title + " " + d.text).lower().split()))  # noqa: E731
        return [sorted(DOCS, key=lambda d: -score(q, d))[:k] for q in queries]


def call(name, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def env(qwen_tok):
    e = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools", topk=2, max_turns=3)
    e.set_tools([*e.tools.values(), open_tool()])
    return e


EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))


def test_prompt_is_the_models_own_template_with_the_tool_schemas(env, qwen_tok):
    state = env.reset(EX)
    messages = env.template.messages(EX.question)
    ids = qwen_tok.apply_chat_template(messages, tools=env.schemas, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert qwen_tok(state.prompt, add_special_tokens=False)["input_ids"] == list(ids)
    assert '"name": "search"' in state.prompt and '"name": "open"' in state.prompt
    assert state.prompt.endswith("<|im_start|>assistant\n")
    assert env.stop_strings == ("<|im_end|>",) and qwen_tok.convert_tokens_to_ids("<|im_end|>") == 151645


def test_parsing_tool_calls(env):
    tools = env.tools
    [ok] = parse_tool_calls(call("search", query="Zelka"), tools)
    assert ok.valid and ok.name == "search" and ok.arguments == {"query": "Zelka"}
    two = parse_tool_calls(
        f"<think>x</think>\n{call('search', query='a')}\n{call('open', doc_id='d1')}", tools
    )
    assert [c.name for c in two] == ["search", "open"] and all(c.valid for c in two)
    as_string = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"a\\"}"}</tool_call>'
    assert parse_tool_calls(as_string, tools)[0].arguments == {"query": "a"}
    cases = {
        '<tool_call>{"name": "search", "arguments": {"query": "a"</tool_call>': "malformed_json",
        '<tool_call>{"arguments": {}}</tool_call>': "missing_name",
        call("browse", url="x"): "unknown_tool",
        call("search", query=3): "bad_arguments",
        call("search", query="a", k="two"): "bad_arguments",
        call("search", query="a", k=True): "bad_arguments",  # a bool is not an integer
        call("search"): "bad_arguments",  # missing the required query
        call("search", query="a", topk=2): "bad_arguments",  # an argument the schema does not have
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>': "bad_arguments",
        '<tool_call>\n{"name": "search"': "unclosed_tool_call",
    }
    for text, error in cases.items():
        got = parse_tool_calls(text, tools)
        assert [c.error for c in got] == [error], text
    assert "must be integer" in parse_tool_calls(call("search", query="a", k="two"), tools)[0].detail


def test_a_turn_with_two_calls_runs_both_and_the_observation_is_the_templates_tool_messages(env, qwen_tok):
    state = env.reset(EX)
    action = f"<think> look </think>\n{call('search', query='Zelka directed')}\n{call('search', query='Paris', k=1)}<|im_end|>"
    obs, done, info = env.step(state, action, stopped=True)
    assert not done and info.kind == "search" and info.valid and info.calls == ("search", "search")
    assert info.query == "Zelka directed" and info.doc_ids[0] == "d3" and len(info.doc_ids) == 3
    assert len(env.retriever.calls) == 2  # k=2 and k=1: one batch each
    # the observation is what the template writes after that assistant turn, up to the next one opened
    msgs = [
        *env.template.messages(EX.question),
        {
            "role": "assistant",
            "content": "<think> look </think>",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "search", "arguments": {"query": "Zelka directed"}},
                },
                {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris", "k": 1}}},
            ],
        },
        {"role": "tool", "content": env.format_docs(state.retrieved[0][:2])},
        {"role": "tool", "content": env.format_docs(state.retrieved[0][2:])},
    ]
    full = qwen_tok.apply_chat_template(msgs, tools=env.schemas, add_generation_prompt=True, tokenize=False)
    assert full.endswith(obs) and obs.startswith(
        "\n<|im_start|>user\n<tool_response>\nDoc 1 [d3](Title: Zelka)"
    )
    assert obs.count("<tool_response>") == 2 and obs.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_every_search_of_a_step_goes_to_the_retriever_in_one_batch(env):
    states = [env.reset(EX) for _ in range(5)]
    env.step_batch(
        states, [f"{call('search', query=f'q{i}')}<|im_end|>" for i in range(5)], stopped=[True] * 5
    )
    assert env.retriever.calls == [["q0", "q1", "q2", "q3", "q4"]]


def test_invalid_calls_get_a_tool_message_saying_why_and_make_the_turn_invalid(env):
    state = env.reset(EX)
    action = f"{call('search', query='Zelka')}\n<tool_call>{{not json}}</tool_call><|im_end|>"
    obs, done, info = env.step(state, action, stopped=True)
    assert not done and not info.valid and info.error == "malformed_json" and info.calls == ("search",)
    assert "Error: the tool call is not valid JSON" in obs and "Doc 1 [d3]" in obs
    state = env.reset(EX)
    many = "".join(call("search", query=f"q{i}") for i in range(6)) + "<|im_end|>"
    obs, _, info = env.step(state, many, stopped=True)
    # the 4 calls allowed run; the 2 past the cap share one message saying so
    assert info.error == "too_many_calls" and obs.count("<tool_response>") == 5 and len(info.calls) == 4
    assert "2 more tool calls not run: at most 4 per turn" in obs


def test_the_answer_is_a_turn_without_tool_calls(env):
    for text, answer in [
        ("<think> it is Ann </think>\nAnn Lee<|im_end|>", "Ann Lee"),
        ("The director is <answer> Ann Lee </answer>.<|im_end|>", "Ann Lee"),
        ("  Ann   Lee \n<|im_end|>", "Ann Lee"),
    ]:
        state = env.reset(EX)
        obs, done, info = env.step(state, text, stopped=True)
        assert done and obs == "" and (info.kind, info.valid, info.answer) == ("answer", True, answer)
        assert state.finish_reason == "answer"
    state = env.reset(EX)
    _, done, info = env.step(state, "<think> hm </think><|im_end|>", stopped=True)
    assert done and not info.valid and info.error == "empty_answer"


def test_turn_budget_then_forced_answer(env):
    state = env.reset(EX)
    for _i in range(3):
        obs, done, _ = env.step(state, f"{call('search', query='Zelka')}<|im_end|>", stopped=True)
        assert not done
    assert obs.count(BUDGET_NOTE.strip()) == 1 and state.force_answer
    _, done, info = env.step(state, f"{call('search', query='more')}<|im_end|>", stopped=True)
    assert done and info.kind == "answer" and info.error == "tool_call_after_budget" and info.answer is None
    state = env.reset(EX)
    for _ in range(3):
        env.step(state, f"{call('search', query='Zelka')}<|im_end|>", stopped=True)
    _, done, info = env.step(state, "Ann Lee<|im_end|>", stopped=True)
    assert done and info.valid and info.forced and info.answer == "Ann Lee"


def test_a_turn_cut_by_the_length_cap_ends_the_episode(env):
    state = env.reset(EX)
    obs, done, info = env.step(state, '<tool_call>\n{"name": "sea', eos=True)
    assert done and obs == "" and state.finish_reason == "eos" and not info.valid


def test_open_reads_a_retrieved_documents_full_text(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), topk=1, doc_max_words=4, max_turns=4)
    env.set_tools([*env.tools.values(), open_tool()])
    state = env.reset(EX)
    obs, _, _ = env.step(state, f"{call('search', query='Paris capital')}<|im_end|>", stopped=True)
    assert (
        "Doc 1 [d1](Title: Paris) Paris is the capital" in obs and "It is large" not in obs
    )  # cut to 4 words
    obs, _, info = env.step(state, f"{call('open', doc_id='d1')}<|im_end|>", stopped=True)
    assert info.kind == "tool" and info.valid and info.calls == ("open",) and info.doc_ids == ("d1",)
    assert obs.count("It is large.") == 20
    obs, _, info = env.step(state, f"{call('open', doc_id='d2')}<|im_end|>", stopped=True)
    assert "no document 'd2' among this episode's search results" in obs and info.kind == "tool"


def lookup_capital(country: str, formal: bool = False) -> str:
    """The capital of a country.

    Args:
        country: the country's name
        formal: the capital's formal name
    """
    if country == "Atlantis":
        raise KeyError(country)
    return {"France": "Paris"}.get(country, "unknown")


def test_a_python_function_is_a_tool(qwen_tok):
    tool = function_tool(lookup_capital)
    assert tool.schema["function"]["name"] == "lookup_capital"
    assert (
        tool.parameters["required"] == ["country"]
        and tool.parameters["properties"]["formal"]["type"] == "boolean"
    )
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), tools=[tool])
    assert '"name": "lookup_capital"' in env.reset(EX).prompt
    state = env.reset(EX)
    obs, _, info = env.step(state, f"{call('lookup_capital', country='France')}<|im_end|>", stopped=True)
    assert "\nParis\n" in obs and info.valid and info.kind == "tool"
    obs, _, info = env.step(state, f"{call('lookup_capital', country='Atlantis')}<|im_end|>", stopped=True)
    assert "Error: KeyError" in obs  # the function's failure is the model's to read; the run goes on


def test_qwen3_template_and_tokens(qwen3_tok):
    ids = qwen3_tok.convert_tokens_to_ids(["<tool_response>", "</tool_response>", "<think>", "</think>"])
    assert ids == [151665, 151666, 151667, 151668] and len(qwen3_tok) == 151669
    fmt = ChatFormat(qwen3_tok, {"enable_thinking": False})
    assert fmt.end_of_turn == "<|im_end|>"
    prompt = fmt.prompt([{"role": "user", "content": "Q"}], [search_tool(None, 3, str).schema])
    assert prompt.startswith("<|im_start|>system\n# Tools") and prompt.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    obs = fmt.after_tool_calls([("search", {"query": "x"})], ["R"])
    assert (
        obs
        == "\n<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_teacher_plays_the_same_episodes_in_both_protocols(small_world, world_bm25, qwen_tok):
    """The scripted teacher (SFT data) writes tool calls in the tool protocol and tags in the tag protocol;
    it reads the same documents, so it searches the same queries and gives the same answers."""
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.search import SearchEnv
    from searchrl.envs.synthetic.teacher import run_teacher

    examples = small_world.examples("test")[:40]
    cfg = TeacherConfig(noisy=True)
    tags = run_teacher(SearchEnv(world_bm25, template="short", topk=1, max_turns=4), examples, cfg)
    tools = run_teacher(ToolEnv(world_bm25, ChatFormat(qwen_tok), topk=1, max_turns=4), examples, cfg)
    assert [s.searches() for s in tools] == [s.searches() for s in tags]
    assert [(s.answer, s.finish_reason) for s in tools] == [(s.answer, s.finish_reason) for s in tags]
    assert sum(s.answer is not None for s in tools) >= 30 and all(
        "<tool_call>" in s.actions[0] for s in tools
    )
