"""Gemma 3's tool calls, prompted as Google's Gemma 3 function-calling guide describes (the model has no tool tokens
and its template, TRL's copy of `google/gemma-3-*`'s `gemma3.jinja`, no tool turns): a call is ``NAME(key=value)``
in a ```` ```tool_code ```` block, the turn ends with ``<end_of_turn>``, and the results come back in the next user
turn in ```` ```tool_output ```` blocks. Tokenized on Qwen2.5's real vocabulary (Gemma's is not redistributable as a
package). An episode's text is byte-equal to the template's own rendering of the conversation written that way;
arguments are Python literals read with `ast`, never evaluated; arbitrary text never raises."""

from __future__ import annotations

from importlib.resources import files

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchrl.core.records import Example
from searchrl.envs import call_formats
from searchrl.envs.call_formats import CODE_OPEN, FENCE, OUTPUT_OPEN
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.python_tools import function_tool
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tools import Tool

from .test_tools import CountingRetriever
from .test_tools_hostile import echo, steps_safely

EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
EOT = "<end_of_turn>"


def shipped(name: str = "gemma3") -> str:
    return (files("trl") / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture
def tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


def env_for(tokenizer) -> ToolEnv:
    tokenizer.chat_template = shipped()
    env = ToolEnv(CountingRetriever(), ChatFormat(tokenizer), topk=2)
    env.set_tools([*env.tools.values(), function_tool(echo)])
    return env


def code(*calls: tuple[str, dict]) -> str:
    return CODE_OPEN + "\n".join(call_formats.python_call(n, a) for n, a in calls) + "\n" + FENCE


def test_the_template_is_read_as_gemma3_and_its_tools_are_described(tokenizer):
    env = env_for(tokenizer)
    fmt = env.format
    assert call_formats.detect(shipped()) == call_formats.resolve("auto", shipped()) == "gemma3"
    assert env.call_format == "gemma3" and not fmt.renders_tools
    assert fmt.ends == (EOT,) and env.stop_strings == (EOT,)
    prompt = env.reset(EX).prompt
    # the system prompt (tools described) is the first user turn's start, as the template merges it
    assert prompt.startswith("<start_of_turn>user\n") and prompt.endswith("<start_of_turn>model\n")
    assert "### search" in prompt and "tool_code" in prompt and prompt.count("<start_of_turn>") == 2


def test_two_rounds_then_the_answer_are_the_templates_rendering(tokenizer):
    """Two calls in one block, then one; the episode's text equals the template's own rendering (tokenizer's
    `apply_chat_template`, no code of ours) of the conversation as Google's guide writes it: calls in the model's
    turn, results as a user turn of ``tool_output`` blocks."""
    env = env_for(tokenizer)
    state = env.reset(EX)
    text = state.prompt
    system, user = env.template.messages(EX.question)
    hand = [{"role": "system", "content": system["content"] + "\n\n" + call_formats.describe("gemma3", env.schemas)},
            user]  # fmt: skip
    messages = [system, user]
    rounds = [
        [("search", {"query": "Zelka", "k": 2}), ("echo", {"text": 'a "quoted" b'})],
        [("search", {"query": "Ann Lee"})],
    ]
    for k, made in enumerate(rounds):
        turn = code(*made)
        [(obs, done, info)] = env.step_batch([state], [turn + EOT])
        assert info.valid and not done and info.calls == tuple(n for n, _ in made)
        assert obs.startswith(f"\n<start_of_turn>user\n{OUTPUT_OPEN}") and obs.endswith(
            "<start_of_turn>model\n"
        )
        body = obs[len("\n<start_of_turn>user\n") : obs.rindex(EOT)]
        results = body[len(OUTPUT_OPEN) : -len("\n" + FENCE)].split(f"\n{FENCE}\n{OUTPUT_OPEN}")
        assert len(results) == len(made) and results[-1] == ('a "quoted" b' if k == 0 else results[-1])
        ids = [f"call{k}{j}" for j in range(len(made))]
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for (n, a), i in zip(made, ids)]},
            *({"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results)),
        ]  # fmt: skip
        hand += [{"role": "assistant", "content": turn}, {"role": "user", "content": body}]
        text += turn + EOT + obs
    assert env.retriever.calls == [["Zelka"], ["Ann Lee"]] and 'a "quoted" b' in text
    [(_, done, info)] = env.step_batch([state], ["Ann Lee" + EOT])
    assert done and info.answer == "Ann Lee"
    messages.append({"role": "assistant", "content": "Ann Lee"})
    hand.append({"role": "assistant", "content": "Ann Lee"})
    whole = text + "Ann Lee" + EOT + "\n"
    assert env.format.render(messages, env.schemas, opened=False) == whole
    assert tokenizer.apply_chat_template(hand, tokenize=False) == whole  # the family's template alone


def test_a_user_message_after_tool_results_joins_their_turn(tokenizer):
    """An agent that adds a user message after the results keeps the turns alternating (the template refuses two
    user turns in a row)."""
    tokenizer.chat_template = shipped()
    fmt = ChatFormat(tokenizer)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"},
        {"role": "user", "content": "now answer"},
    ]  # fmt: skip
    out = fmt.render(messages)
    assert f'{CODE_OPEN}search(query="x")\n{FENCE}{EOT}' in out
    assert f"<start_of_turn>user\n{OUTPUT_OPEN}r\n{FENCE}\n\nnow answer{EOT}" in out


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: k not in {"if", "in", "is", "or"}),
        st.recursive(
            st.one_of(st.none(), st.text(max_size=12), st.integers(-(10**6), 10**6), st.booleans(), st.floats(
                allow_nan=False, allow_infinity=False)),
            lambda inner: st.one_of(
                st.lists(inner, max_size=3),
                st.dictionaries(st.text(max_size=6), inner, max_size=3),
            ),
            max_leaves=8,
        ),
        max_size=4,
    )
)  # fmt: skip
def test_written_arguments_read_back(args):
    """`write` then `parse`: Python literals round-trip (a string holding the fence aside: it closes the block)."""
    import keyword

    if any(keyword.iskeyword(k) for k in args) or FENCE in str(args):
        return
    tool = Tool("echo", "", {"type": "object", "properties": {k: {} for k in args}}, run=lambda batch: [])
    [c] = call_formats.parse("gemma3", call_formats.write("gemma3", "echo", args), {"echo": tool})
    assert c.valid and c.name == "echo" and c.arguments == args


def test_several_blocks_and_lines_run_in_order_up_to_the_limit():
    tools = {"echo": function_tool(echo)}
    text = code(("echo", {"text": "a"}), ("echo", {"text": "b"})) + "\nthen\n" + code(("echo", {"text": "c"}))
    assert [c.arguments["text"] for c in call_formats.parse("gemma3", text, tools)] == ["a", "b", "c"]
    capped = call_formats.parse("gemma3", text, tools, limit=2)
    assert [c.error for c in capped] == [None, None, "too_many_calls"] and "1 more" in capped[-1].detail
    assert call_formats.parse("gemma3", "The answer is Ann Lee.", tools) == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("echo(text=", "malformed_json"),
        ('echo("x")', "bad_arguments"),  # positional
        ("echo(**{'text': 'x'})", "bad_arguments"),
        ("echo(text=open('/etc/passwd').read())", "bad_arguments"),  # not a literal: never evaluated
        ("echo(text=__import__('os').system('true'))", "bad_arguments"),
        ("x = 1", "missing_name"),
        ("os.system('true')", "missing_name"),
        ("nope(text='x')", "unknown_tool"),
        ("echo(text=1)", "bad_arguments"),  # the schema's type
        ("echo(text='x', text='y')", "duplicate_key"),  # Python's parser takes it; the compiler would not
        ("echo(text=" + "[" * 300 + "]" * 300 + ")", "malformed_json"),  # too deep for the parser
        ("echo(text=" + "9" * 5000 + ")", "malformed_json"),  # past Python's 4,300-digit limit
        ("echo(text='\x00')", "malformed_json"),  # Python refuses a NUL in source
        ("", "missing_name"),
    ],
)
def test_malformed_calls_say_why(body, error):
    [c] = call_formats.parse("gemma3", f"{CODE_OPEN}{body}\n{FENCE}", {"echo": function_tool(echo)})
    assert c.error == error and not c.valid and c.detail


def test_an_unclosed_block_is_one_more_invalid_call():
    calls = call_formats.parse("gemma3", code(("echo", {"text": "a"})) + CODE_OPEN + "echo(text='b')", {
        "echo": function_tool(echo)})  # fmt: skip
    assert [c.error for c in calls] == [None, "unclosed_tool_call"]


PIECES = st.sampled_from(
    [CODE_OPEN, OUTPUT_OPEN, FENCE, "search", "echo", "(", ")", "=", ",", "query", "text", "'", '"', "[", "]",
     "{", "}", "\n", EOT, "<start_of_turn>user\n", "**", "lambda", "\\", "\u00e9", "\x00"]
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=80))
def test_any_turn_is_calls_that_run_or_say_why(tokenizer, pieces):
    steps_safely(env_for(tokenizer), EX, pieces, EOT)


def gemma_turns(prompt: str) -> str:
    """Search twice, then answer, as Gemma 3 is prompted to write it."""
    n = prompt.count(OUTPUT_OPEN)
    if n >= 2:
        return "Ann Lee" + EOT
    return ["I will search.\n", ""][n] + code(("search", {"query": ["Zelka director", "Ann Lee"][n]})) + EOT


def test_an_openai_client_agent_on_gemma3_trains_on_the_templates_text(tokenizer, monkeypatch):
    """The example agent (plain `openai` client) through the policy endpoint: its two tool rounds extend one row,
    whose text is the template's rendering of the whole conversation (the text before a call block comes back as
    the message's content, and renders back as the model wrote it)."""
    from ..rollout.test_agent_program import example_agent_episode

    tokenizer.chat_template = shipped()
    t, messages, tools = example_agent_episode(
        tokenizer, gemma_turns, monkeypatch, contents=("I will search.", None)
    )
    whole = ChatFormat(tokenizer).render(messages, tools, opened=False).removesuffix("\n")
    assert tokenizer.decode(t.token_ids) == whole


def test_gemma2s_template_refuses_a_system_message_so_the_prompt_opens_the_user_turn(tokenizer):
    """Gemma 2's template (TRL's `gemma.jinja`) raises on a system message: the system prompt opens the first user
    turn, as Gemma 3's template writes it, and the calls are Gemma 3's (the same guide)."""
    tokenizer.chat_template = shipped("gemma")
    env = ToolEnv(CountingRetriever(), ChatFormat(tokenizer), topk=2)
    assert env.call_format == "gemma3" and not env.format.takes_system
    state = env.reset(EX)
    system, user = env.template.messages(EX.question)
    described = system["content"] + "\n\n" + call_formats.describe("gemma3", env.schemas)
    turn = code(("search", {"query": "Zelka"})) + EOT
    [(obs, _, info)] = env.step_batch([state], [turn])
    assert info.valid and obs.startswith(f"\n<start_of_turn>user\n{OUTPUT_OPEN}")
    hand = [{"role": "user", "content": f"{described}\n\n{user['content']}"}, {"role": "assistant",
            "content": turn.removesuffix(EOT)}, {"role": "user", "content": obs.split("user\n", 1)[1].split(EOT)[0]}]  # fmt: skip
    assert (
        tokenizer.apply_chat_template(hand, tokenize=False, add_generation_prompt=True)
        == state.prompt + turn + obs
    )
