"""gpt-oss's harmony format on its template as shipped (TRL's copy of `openai/gpt-oss-20b`'s, `gptoss.jinja`),
tokenized on Qwen2.5's real vocabulary (gpt-oss's o200k_harmony is not on a package registry): the generation
prompt opens ``<|start|>assistant``; the model may reason first (``<|channel|>analysis<|message|>…<|end|>``),
then makes one call `` to=functions.NAME<|channel|>commentary json<|message|>{…}<|call|>`` or answers
``<|channel|>final<|message|>…<|return|>``. Episodes are byte-equal to the template's rendering; the template
drops a calling turn's reasoning once a final answer follows (a re-rendering family: the endpoint then starts a new
row); arbitrary text never raises."""

from __future__ import annotations

from importlib.resources import files

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs import call_formats
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv

from .test_tools import CountingRetriever
from .test_tools_hostile import echo, steps_safely

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
CALL, RETURN = "<|call|>", "<|return|>"
RESULT = "<|start|>functions.search to=assistant<|channel|>commentary<|message|>"


def shipped() -> str:
    return (files("trl") / "chat_templates" / "gptoss.jinja").read_text()


@pytest.fixture
def tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    tok.chat_template = shipped()
    return tok


def env_for(tokenizer) -> ToolEnv:
    env = ToolEnv(CountingRetriever(), ChatFormat(tokenizer), topk=2)
    env.set_tools([*env.tools.values(), function_tool(echo)])
    return env


def call(name: str, **arguments) -> str:
    return call_formats.write("gpt_oss", name, arguments) + CALL


def test_the_template_is_read_as_harmony(tokenizer):
    env = env_for(tokenizer)
    fmt = env.format
    assert call_formats.detect(shipped()) == call_formats.resolve("auto", shipped()) == "gpt_oss"
    assert env.call_format == "gpt_oss" and fmt.renders_tools and not fmt.opens_think
    assert (fmt.end_of_turn, fmt.call_end) == (RETURN, CALL) and set(env.stop_strings) == {RETURN, CALL}
    prompt = env.reset(EX).prompt
    assert prompt.endswith("<|start|>user<|message|>Question: Who directed Zelka?<|end|><|start|>assistant")
    assert "namespace functions {" in prompt and "type search = (_: {" in prompt


def test_two_rounds_then_the_answer_are_the_templates_rendering(tokenizer):
    env = env_for(tokenizer)
    state = env.reset(EX)
    text, messages = state.prompt, [*env.template.messages(EX.question)]
    for k, (name, args) in enumerate(
        [("search", {"query": "Zelka", "k": 2}), ("echo", {"text": 'a "q" <b>'})]
    ):
        turn = call(name, **args)
        [(obs, done, info)] = env.step_batch([state], [turn])
        assert info.valid and not done and info.calls == (name,)
        head = f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
        assert obs.startswith(head) and obs.endswith("<|end|><|start|>assistant")
        import json

        result = json.loads(obs[len(head) : -len("<|end|><|start|>assistant")])  # the template's tojson
        messages += [
            {"role": "assistant", "tool_calls": [{"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": result},
        ]  # fmt: skip
        text += turn + obs
    assert env.retriever.calls == [["Zelka"]] and 'a \\"q\\" <b>' in text
    answer = "<|channel|>final<|message|>Ann Lee" + RETURN
    [(_, done, info)] = env.step_batch([state], [answer])
    assert done and info.answer == "Ann Lee"
    messages.append({"role": "assistant", "content": "Ann Lee"})
    assert env.format.render(messages, env.schemas, opened=False) == text + answer


def test_reasoning_is_kept_while_the_episode_calls_and_dropped_by_the_template_after_the_answer(tokenizer):
    """A calling turn's analysis message is rendered back (as ``thinking``) while calls go on, so the episode is
    the template's rendering turn after turn; once a final answer follows, the template drops it: the whole
    conversation re-rendered is not the episode (the tool protocol never re-renders it; the agent endpoint starts
    a new row there)."""
    env = env_for(tokenizer)
    state = env.reset(EX)
    turn = env.write_search("I should look Zelka up.", "Zelka")
    assert turn.startswith(
        "<|channel|>analysis<|message|>I should look Zelka up.<|end|><|start|>assistant to="
    )
    [(obs, _, info)] = env.step_batch([state], [turn])
    assert info.valid and info.query == "Zelka"
    import json

    result = json.loads(obs[len(RESULT) : -len("<|end|><|start|>assistant")])
    messages = [
        *env.template.messages(EX.question),
        {"role": "assistant", "thinking": "I should look Zelka up.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Zelka"}}}]},
        {"role": "tool", "content": result},
    ]  # fmt: skip
    assert env.format.render(messages, env.schemas) == state.prompt + turn + obs
    answer = env.write_answer("Ann Lee")
    [(_, done, info)] = env.step_batch([state], [answer])
    assert done and info.answer == "Ann Lee"
    whole = env.format.render(
        [*messages, {"role": "assistant", "content": "Ann Lee"}], env.schemas, opened=False
    )
    assert "I should look Zelka up." not in whole and whole != state.prompt + turn + obs + answer


@pytest.mark.parametrize(
    ("text", "error", "name"),
    [
        ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "x"}', None, "search"),
        (' to=functions.search<|channel|>commentary json<|message|>{"query": "x"', "malformed_json", None),
        (' to=functions.search<|channel|>commentary json<|message|>{"query": "x", "query": "y"}', "duplicate_key", None),
        (' to=functions.nope<|channel|>commentary json<|message|>{}', "unknown_tool", "nope"),
        (' to=functions.search<|channel|>commentary json', "unclosed_tool_call", None),
        (' to=functions.search<|channel|>commentary json<|message|>{"k": 2}', "bad_arguments", "search"),
    ],
)  # fmt: skip
def test_calls_read_or_say_why(tokenizer, text, error, name):
    env = env_for(tokenizer)
    [c] = env.calls(text + CALL)
    assert c.error == error and c.name == name and (c.valid or c.detail)


def test_a_call_inside_the_reasoning_is_not_run(tokenizer):
    env = env_for(tokenizer)
    text = '<|channel|>analysis<|message|>maybe to=functions.search<|message|>{"query": "x"}<|end|>'
    assert env.calls(text + "<|start|>assistant<|channel|>final<|message|>Ann Lee" + RETURN) == []
    info = env.parse(text + "<|start|>assistant<|channel|>final<|message|>Ann Lee" + RETURN)
    assert info.kind == "answer" and info.answer == "Ann Lee"


PIECES = st.sampled_from(
    ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "assistant", CALL, RETURN, "<|constrain|>", "analysis",
     "final", "commentary", " to=functions.", "search", "echo", "json", "{", "}", '"query"', ":", '"', "\u00e9"]
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=80))
def test_any_turn_is_calls_that_run_or_say_why(tokenizer, pieces):
    steps_safely(env_for(tokenizer), EX, pieces, RETURN)


def harmony_turns(prompt: str) -> str:
    """Search twice, reasoning first, then answer, as gpt-oss writes it (each turn ended as the model ends it)."""
    n = prompt.count(RESULT)
    if n >= 2:
        return (
            "<|channel|>analysis<|message|>Found it.<|end|><|start|>assistant<|channel|>final<|message|>Ann Lee"
            + RETURN
        )
    query = ["Zelka director", "Ann Lee"][n]
    return f"<|channel|>analysis<|message|>Search {query}.<|end|><|start|>assistant" + call(
        "search", query=query
    )


def test_an_openai_client_agent_on_gpt_oss_keeps_one_row_with_its_reasoning(tokenizer, monkeypatch):
    """The example agent through the policy endpoint: each reply's reasoning comes back as ``reasoning_content``
    and is rendered back as the template's ``thinking``, so the two tool rounds and the answer extend one row,
    whose text is what was sampled between what the template rendered."""
    from ..rollout.test_agent_program import example_agent_episode

    t, messages, tools = example_agent_episode(tokenizer, harmony_turns, monkeypatch)
    for k, q in enumerate(("Zelka director", "Ann Lee")):
        messages[2 + 2 * k].update(thinking=f"Search {q}.", content="")  # as the endpoint reads them back
    text = tokenizer.decode(t.token_ids)
    before_answer = ChatFormat(tokenizer).render(messages[:-1], tools)
    assert text.startswith(before_answer) and text.endswith("<|channel|>final<|message|>Ann Lee" + RETURN)
