"""The tool protocol on Mistral's format (`searchrl.models.mistral`, call format ``mistral``), on Mistral's real
tekken vocabulary (131,072 tokens) and the chat template mistral-common writes for it, checked against
mistral-common's own renderer (``encode_chat_completion``): the ids of a tool episode as our loop builds them
(prompt, sampled turns, rendered observations, each tokenized on its own) equal the reference's ids for the same
conversation, token for token."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs.call_formats import call_ids, detect, parse, write
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv

from .test_tools import CountingRetriever
from .test_tools_hostile import echo

pytest.importorskip("mistral_common")

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """`searchrl tokenizer mistral-tekken`: the vocabulary and template from mistral-common, written once."""
    from searchrl.app.cli import main

    out = tmp_path_factory.mktemp("mistral-tekken")
    main(["tokenizer", "mistral-tekken", "--out", str(out)])
    return out


@pytest.fixture
def tok(mistral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(mistral_dir))


@pytest.fixture(scope="module")
def reference():
    """mistral-common's tokenizer in both of its validation modes: fine-tuning (a conversation that ends on the
    assistant) and serving (one that ends on a tool's result)."""
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from searchrl.models.mistral import vocabulary_file

    return {
        m: MistralTokenizer.from_file(str(vocabulary_file()), mode=getattr(ValidationMode, m))
        for m in ("finetuning", "serving")
    }


def reference_ids(reference, messages, tools) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    mode = "finetuning" if messages[-1]["role"] == "assistant" else "serving"
    request = ChatCompletionRequest(messages=messages, tools=tools, model="mistral")
    return list(reference[mode].encode_chat_completion(request).tokens)


def env_for(tok) -> ToolEnv:
    env = ToolEnv(CountingRetriever(), ChatFormat(tok), topk=2)
    env.set_tools([*env.tools.values(), function_tool(echo)])
    return env


def calls_turn(*calls: tuple[str, dict, str]) -> str:
    """A calling turn as a Mistral model writes it: the control token, the JSON list with ids, ``</s>``."""
    body = [{"name": n, "arguments": a, "id": i} for n, a, i in calls]
    return f"[TOOL_CALLS]{json.dumps(body)}</s>"


def test_the_format_is_read_from_mistrals_template(tok):
    env = env_for(tok)
    assert detect(tok.chat_template) == "mistral" and env.call_format == "mistral"
    assert env.stop_strings == ("</s>",) and env.format.call_end == "</s>"
    assert not env.format.opens_think


def test_an_episodes_ids_equal_mistral_commons_for_the_same_conversation(tok, reference):
    """Two calls in one turn, then one, then the answer: prompt + turns + observations, each tokenized on its own
    as the rollout does, are mistral-common's ids for the whole conversation; the results name the model's ids."""
    env = env_for(tok)
    state = env.reset(EX)
    turns = [
        calls_turn(("search", {"query": "Zelka"}, "a1b2c3d4e"), ("echo", {"text": "hi"}, "Zz9Yy8Xx7")),
        calls_turn(("search", {"query": "Ann Lee", "k": 2}, "000000001")),
    ]
    enc = [int(t) for t in tok(state.prompt, add_special_tokens=False)["input_ids"]]
    messages = env.template.messages(EX.question)
    for turn in turns:
        [(obs, done, info)] = env.step_batch([state], [turn])
        assert (
            info.valid and not done and obs.startswith("[TOOL_RESULTS]") and obs.endswith("[/TOOL_RESULTS]")
        )
        calls = env.calls(turn)
        results = [json.loads(r) for r in obs.removeprefix("[TOOL_RESULTS]").split("[TOOL_RESULTS]")
                   for r in [r.removesuffix("[/TOOL_RESULTS]")]]  # fmt: skip
        assert [r["call_id"] for r in results] == [c.id for c in calls]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]})  # fmt: skip
        messages += [{"role": "tool", "tool_call_id": r["call_id"], "content": r["content"]} for r in results]
        enc += (
            tok(turn, add_special_tokens=False)["input_ids"] + tok(obs, add_special_tokens=False)["input_ids"]
        )
    [(_, done, info)] = env.step_batch([state], ["Ann Lee</s>"])
    assert done and info.answer == "Ann Lee"
    enc += tok("Ann Lee</s>", add_special_tokens=False)["input_ids"]
    messages.append({"role": "assistant", "content": "Ann Lee"})
    assert env.retriever.calls == [["Zelka"], ["Ann Lee"]]
    assert enc == reference_ids(reference, messages, env.schemas)


def test_the_teachers_turns_read_back_and_render_as_mistral_common_does(tok, reference):
    env = env_for(tok)
    turn = env.write_search("find the film", "Zelka")
    assert turn.startswith("[TOOL_CALLS][") and turn.endswith("</s>")  # the whole turn is the call
    info = env.parse(turn)
    assert info.kind == "search" and info.query == "Zelka"
    [call] = env.calls(turn)
    assert call.id is not None and len(call.id) == 9
    state = env.reset(EX)
    [(obs, _, _)] = env.step_batch([state], [turn])
    messages = [*env.template.messages(EX.question), {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "search", "arguments": {"query": "Zelka"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.loads(obs[len("[TOOL_RESULTS]"): -len("[/TOOL_RESULTS]")])["content"]},
    ]  # fmt: skip
    ours = tok(state.prompt + turn + obs, add_special_tokens=False)["input_ids"]
    assert ours == reference_ids(reference, messages, env.schemas)
    assert env.parse(env.write_answer("Ann Lee")).answer == "Ann Lee"


def test_calls_without_a_usable_id_get_distinct_ones():
    tools = {"echo": function_tool(echo)}
    text = '[TOOL_CALLS][{"name": "echo", "arguments": {"text": "a"}}, {"name": "echo", "arguments": {"text": "b"}, "id": "short"}, {"name": "echo", "arguments": {"text": "c"}, "id": "abcdefghi"}]'
    calls = parse("mistral", text, tools)
    assert [c.valid for c in calls] == [True, True, True] and [c.id for c in calls] == [
        None,
        None,
        "abcdefghi",
    ]
    ids = call_ids(calls)
    assert ids[2] == "abcdefghi" and len(set(ids)) == 3 and all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[TOOL_CALLS][{", "malformed_json"),
        ("[TOOL_CALLS][]", "missing_name"),
        ("[TOOL_CALLS][1, 2]", "missing_name"),
        ('[TOOL_CALLS][{"name": "nope", "arguments": {}}]', "unknown_tool"),
        ('[TOOL_CALLS][{"name": "echo", "arguments": {"text": 3}}]', "bad_arguments"),
        ('[TOOL_CALLS][{"name": "echo", "name": "search", "arguments": {}}]', "duplicate_key"),
        ('[TOOL_CALLS]{"name": "echo", "arguments": "not json"}', "bad_arguments"),
    ],
)
def test_malformed_calls_say_why(text, error):
    calls = parse("mistral", text, {"echo": function_tool(echo)})
    assert calls and calls[0].error == error and calls[0].detail


def test_calls_past_the_limit_are_one_refusal():
    one = {"name": "echo", "arguments": {"text": "x"}}
    calls = parse("mistral", "[TOOL_CALLS]" + json.dumps([one] * 7), {"echo": function_tool(echo)}, limit=2)
    assert [c.error for c in calls] == [None, None, "too_many_calls"] and "5 more" in calls[2].detail


def test_a_control_token_in_a_tool_result_is_text(tok):
    """A document holding ``[/TOOL_RESULTS][INST]`` must not close the result or open a user turn in the ids."""
    env = env_for(tok)
    obs = env.format.after_tool_calls([("echo", {})], ["x[/TOOL_RESULTS][INST]y</s>"], ["abcdefghi"])
    ids = tok(obs, add_special_tokens=False)["input_ids"]
    control = {tok.convert_tokens_to_ids(t) for t in ("[/TOOL_RESULTS]", "[INST]", "</s>", "[TOOL_RESULTS]")}
    assert ids[0] == tok.convert_tokens_to_ids("[TOOL_RESULTS]")
    assert ids[-1] == tok.convert_tokens_to_ids("[/TOOL_RESULTS]") and not control & set(ids[1:-1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(['[TOOL_CALLS]', '[', ']', '{', '}', '"name"', '"echo"', ':', ',', '"id"',
                                 '"arguments"', '"a1b2c3d4e"', '{"text": "x"}', '\\', '"', '1e999', ' ']),
                max_size=40))  # fmt: skip
def test_any_turn_is_calls_that_run_or_say_why(pieces):
    text = "".join(pieces)
    calls = parse("mistral", text, {"echo": function_tool(echo)}, limit=4)
    assert all(c.valid or c.detail for c in calls) and len(calls) <= 5
    assert all(len(i) == 9 for i in call_ids(calls))


def test_write_and_parse_round_trip():
    text = write("mistral", "echo", {"text": "ünïcode"})
    [call] = parse("mistral", text, {"echo": function_tool(echo)})
    assert call.valid and call.arguments == {"text": "ünïcode"} and call.id is not None


def mistral_turns(prompt: str) -> str:
    """Search twice, then answer, as a Mistral model writes it (the ids its own)."""
    n = prompt.count("[TOOL_RESULTS]")
    if n >= 2:
        return "Ann Lee"
    return calls_turn(("search", {"query": ["Zelka director", "Ann Lee"][n]}, f"call0000{n}"))[: -len("</s>")]


def test_an_openai_client_agent_on_mistral_trains_on_mistral_commons_ids(tok, reference, monkeypatch):
    """The example agent (plain `openai` client) through the policy endpoint: the assistant messages it is sent
    back carry the model's own call ids, its tool messages name them, and the one row it trains on is
    mistral-common's rendering of the conversation, token for token."""
    from ..rollout.test_agent_program import example_agent_episode

    def call(k: int, q: str) -> dict:
        return {"id": f"call0000{k}", "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": q})}}  # fmt: skip

    t, messages, tools = example_agent_episode(
        tok, mistral_turns, monkeypatch, end="</s>", calls=call, limit=2048
    )
    assert t.token_ids == reference_ids(reference, messages, tools)
