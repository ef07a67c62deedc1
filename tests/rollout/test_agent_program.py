"""Agent programs through the policy endpoint (`rollout.policy_endpoint`, `rollout.agent_program`): an agent written
with the plain ``openai`` client, several tool turns, on Qwen2.5's and Qwen3's real templates and vocabulary. Every
trained token is one the policy sampled or one the template rendered, and the rows equal what our own tool loop
builds for the same conversation; a rewritten history or a sub-agent makes rows of one episode; what a program
or a caller does wrong ends its episode, never the run."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from searchrl.core.records import Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.context import unfold
from searchrl.rollout.agent_program import AgentProgramEnv, assemble, check_program
from searchrl.rollout.generator import Generation, SamplingParams
from searchrl.rollout.loop import rollout

from ..envs.test_tools import CountingRetriever

pytest.importorskip("openai")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
EX = Example(id="q1", question="Who directed Zelka?", answers=("Ann Lee",))
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64)


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Scripted:
    """A generator whose turn is a function of the prompt's text; each sampled token gets log-prob -0.5. It
    records every prompt it was given and its sampling parameters."""

    def __init__(self, tok, script, end="<|im_end|>"):
        self.tok, self.script, self.end = tok, script, end
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.lock = threading.Lock()

    def generate(self, prompts, params, cache_keys=None):
        out = []
        for p in prompts:
            with self.lock:
                self.prompts.append(list(p)), self.params.append(params)
            turn = self.script(self.tok.decode(p))
            ids = self.tok.encode(turn + ("" if turn.endswith(("<|observation|>", "<|user|>")) else self.end),
                                  add_special_tokens=False)  # fmt: skip
            ids = ids[: params.max_new_tokens]
            out.append(
                Generation(ids, [-0.5] * len(ids), "stop" if len(ids) < params.max_new_tokens else "length")
            )
        return out

    def release(self, cache_keys=None):
        pass


def three_turns(prompt: str) -> str:
    """Search twice, then answer."""
    n = prompt.count("<tool_response>")
    return [call("search", query="Zelka director"), call("search", query="Ann Lee"), "Ann Lee"][min(n, 2)]


@pytest.fixture
def agent_module(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("openai_search_agent", None)
    import openai_search_agent

    return openai_search_agent


def env_for(tok, program, **kwargs) -> AgentProgramEnv:
    return AgentProgramEnv(
        CountingRetriever(), ChatFormat(tok), program=program, template="tools", topk=1, max_turns=3, **kwargs
    )


def example_agent_episode(
    tok, turns, monkeypatch, end: str = "", calls=None, contents=(None, None), limit=4096
):
    """The example agent (`examples/agents/openai_search_agent.py`, plain `openai` client) through the policy
    endpoint on ``tok``'s template, the policy scripted by ``turns`` (searching "Zelka director", then "Ann Lee",
    then answering). Returns its trajectory, the conversation as OpenAI messages (the assistant turns' ``contents``,
    each call as ``calls(k, query)`` makes it, by default without an id) and the tool schemas it sent."""
    pytest.importorskip("openai")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("openai_search_agent", None)
    import openai_search_agent

    env = env_for(tok, openai_search_agent.run)
    [t], _ = rollout([EX], env, Scripted(tok, turns, end=end), tok, PARAMS, 1, limit)
    assert t.answer == "Ann Lee" and t.info["agent_rows"] == 1
    assert Path(openai_search_agent.__file__).parent == EXAMPLES
    messages = [{"role": "system", "content": openai_search_agent.SYSTEM},
                {"role": "user", "content": f"Question: {EX.question}"}]  # fmt: skip
    for k, q in enumerate(("Zelka director", "Ann Lee")):
        call = (
            calls(k, q)
            if calls
            else {"type": "function", "function": {"name": "search", "arguments": {"query": q}}}
        )
        result = {"role": "tool", "content": env.format_docs(env.retriever.search([q], 1)[0])}
        messages += [{"role": "assistant", "content": contents[k], "tool_calls": [call]},
                     {**result, **({"tool_call_id": call["id"]} if "id" in call else {})}]  # fmt: skip
    messages.append({"role": "assistant", "content": "Ann Lee"})
    return t, messages, openai_search_agent.TOOLS


def glm_turns(prompt: str) -> str:
    """`three_turns` as GLM-4.5 writes them: each ended as the model ends it."""
    from searchrl.envs.call_formats import write

    n = prompt.count("<tool_response>")
    if n >= 2:
        return "\n<think></think>\nAnn Lee<|user|>"
    query = ["Zelka director", "Ann Lee"][n]
    return f"\n<think></think>\n{write('glm45', 'search', {'query': query})}<|observation|>"


def own_loop_ids(tok, env: AgentProgramEnv, actions: list[str], queries: list[str]) -> list[int]:
    """The ids our tool loop builds for the conversation: the prompt, each sampled turn, each tool message's
    rendering after it (`ChatFormat.after_tool_calls`)."""
    from openai_search_agent import SYSTEM, TOOLS

    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question: {EX.question}"},
    ]
    ids = enc(env.format.prompt(messages, TOOLS))
    for k, a in enumerate(actions):
        ids += enc(a if a.endswith(("<|observation|>", "<|user|>")) else a + "<|im_end|>")
        if k < len(queries):
            docs = env.retriever.search([queries[k]], 1)[0]
            ids += enc(env.format.after_tool_calls([("search", {})], [env.format_docs(docs)]))
    return ids


@pytest.mark.parametrize("which", ["qwen2.5", "qwen3", "glm4.5"])
def test_an_openai_client_agent_trains_on_the_ids_our_loop_would_build(
    agent_module, qwen_tok, qwen3_tok, qwen_tokenizer_dir, which
):
    """Qwen2.5's and Qwen3's templates, and GLM-4.5's as shipped (TRL's copy, on Qwen2.5's vocabulary): a template
    that closes no turn, whose calling turns end with the ``<|observation|>`` that opens the tool messages."""
    from importlib.resources import files

    from transformers import AutoTokenizer

    tok = {"qwen2.5": qwen_tok, "qwen3": qwen3_tok}.get(which)
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
        tok.chat_template = (files("trl") / "chat_templates" / "glm4moe.jinja").read_text()
    env = env_for(tok, agent_module.run)
    script = glm_turns if which == "glm4.5" else three_turns
    gen = Scripted(tok, script)
    trajs, stats = rollout([EX], env, gen, tok, PARAMS, group_size=2, max_total_tokens=2048)
    assert len(trajs) == 2 and stats.episodes == 2
    for t in trajs:
        assert t.answer == "Ann Lee" and t.finish_reason == "answer"
        assert t.info["agent_rows"] == 1 and "context_folds" not in t.info  # every call extended the last
        actions = [s for s in t.segments if s.kind == "action"]
        assert len(actions) == 3 and all(s.logprobs == [-0.5] * len(s.token_ids) for s in actions)
        # the row is the last call's prompt and what it sampled, and the ids our own loop builds
        assert t.token_ids[: -len(actions[-1].token_ids)] in gen.prompts
        turns = [script("<tool_response>" * n) for n in range(3)]
        expected = own_loop_ids(tok, env, turns, ["Zelka director", "Ann Lee"])
        assert t.token_ids == expected
        # what the agent searched is the episode's retrievals (gold recall, retrieval rewards)
        assert [q for q, _ in t.episode.searches()] == ["Zelka director", "Ann Lee"]
    assert all(p.temperature == 1.0 and p.max_new_tokens == 64 for p in gen.params)  # the run's sampling
    assert float(stats.metrics()["agent/split_episodes"]) == 0.0


def test_every_trained_token_was_sampled_or_rendered(agent_module, qwen_tok):
    gen = Scripted(qwen_tok, three_turns)
    env = env_for(qwen_tok, agent_module.run)
    [t], _ = rollout([EX], env, gen, qwen_tok, PARAMS, 1, 2048)
    ends = [len(p) for p in gen.prompts]
    pos = 0
    for s in t.segments:
        if (
            s.kind == "action"
        ):  # exactly a sampled completion, placed right after the prompt it was sampled from
            assert pos in ends and s.token_ids == qwen_tok.encode(
                three_turns(qwen_tok.decode(t.token_ids[:pos])) + "<|im_end|>", add_special_tokens=False
            )
        else:  # the template's rendering: a slice of a prompt the endpoint sent to the policy
            assert any(p[pos : pos + len(s.token_ids)] == s.token_ids for p in gen.prompts if len(p) > pos)
        pos += len(s.token_ids)


def rewriting_agent(question: str, base_url: str, search) -> str | None:
    """Folds its history after the first search: the second call starts from a new conversation."""
    from openai import OpenAI
    from openai_search_agent import SYSTEM, TOOLS

    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question: {question}"}]
    m = client.chat.completions.create(model="p", messages=messages, tools=TOOLS).choices[0].message
    found = search(json.loads(m.tool_calls[0].function.arguments)["query"])
    messages = [messages[0], {"role": "user", "content": f"Question: {question}\nKnown: {found}"}]
    return (
        client.chat.completions.create(model="p", messages=messages, tools=TOOLS).choices[0].message.content
    )


def test_a_rewritten_history_trains_as_rows_of_one_episode(agent_module, qwen_tok):
    def script(prompt: str) -> str:
        return "Ann Lee" if "Known:" in prompt else call("search", query="Zelka director")

    env = env_for(qwen_tok, rewriting_agent)
    trajs, stats = rollout([EX], env, Scripted(qwen_tok, script), qwen_tok, PARAMS, 2, 2048)
    for t in trajs:
        t.reward = 1.0
    assert all(t.info["agent_rows"] == 2 for t in trajs)
    assert float(stats.metrics()["agent/split_episodes"]) == 1.0
    rows = unfold(trajs)
    assert len(rows) == 4 and len({r.episode_id for r in rows}) == 2
    assert all(r.reward == 1.0 for r in rows)
    first, last = rows[0], rows[1]
    assert first.finish_reason == "folded" and "<tool_call>" in qwen_tok.decode(first.segments[-1].token_ids)
    assert "Known:" in qwen_tok.decode(last.segments[0].token_ids) and last.answer == "Ann Lee"


def test_rows_follow_each_conversation_a_sub_agent_interleaves():
    from searchrl.rollout.policy_endpoint import Call

    a1 = Call([1, 2], [3], [-0.1], 0, "tool_calls", None)
    b1 = Call([9, 9], [8], [-0.2], 0, "stop", None)  # a sub-agent's own conversation
    a2 = Call([1, 2, 3, 4, 5], [6], [-0.3], 0, "stop", 0)
    rows, where = assemble([a1, b1, a2])
    ids = [[t for s in segs for t in s.token_ids] for segs, _ in rows]
    assert ids == [[1, 2, 3, 4, 5, 6], [9, 9, 8]] and where["last_row"] == 0
    assert [s.kind for s in rows[0][0]] == ["prompt", "action", "observation", "action"]
    assert [st.last_token for st in rows[0][1]] == [2, 5]


def crashing(question: str) -> str:
    raise RuntimeError("the agent's own bug")


def hanging(question: str) -> str:
    time.sleep(30)
    return "late"


def odd_return(question: str) -> object:
    return {"no": "answer key"}


def greedy_caller(question: str, base_url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    for _ in range(10):  # past the call budget: the tenth call is refused, the program raises
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": question}])
    return "never"


@pytest.mark.parametrize(
    "program,finish",
    [(crashing, "error"), (hanging, "timeout"), (odd_return, "no_answer"), (greedy_caller, "budget")],
)
def test_a_program_that_fails_ends_its_episode_not_the_run(qwen_tok, program, finish):
    env = env_for(qwen_tok, program, timeout=1.0, max_calls=3)
    t0 = time.monotonic()
    trajs, stats = rollout([EX], env, Scripted(qwen_tok, lambda p: "Ann"), qwen_tok, PARAMS, 2, 2048)
    assert time.monotonic() - t0 < 15
    assert [t.finish_reason for t in trajs] == [finish, finish] and all(t.answer is None for t in trajs)
    assert all(len(t) > 0 for t in trajs)  # a row (the question, or what was sampled) that scores 0
    m = stats.metrics()
    key = {"error": "agent/errors", "timeout": "agent/timeouts", "no_answer": "agent/no_answer"}.get(finish)
    if key:
        assert float(m[key]) == 2
    if finish == "budget":
        assert all(len([s for s in t.segments if s.kind == "action"]) >= 1 for t in trajs)


def test_programs_are_checked_before_a_run(agent_module):
    assert check_program("openai_search_agent:run") is agent_module.run
    with pytest.raises(Exception, match="requires argument"):
        check_program(lambda question, tokens: None)
    with pytest.raises(Exception, match="no positional"):
        check_program(lambda: None)
    with pytest.raises(Exception, match="cannot import"):
        check_program("no_such_module_here:run")


def thinking_turns(prompt: str) -> str:
    n = prompt.count("<tool_response>")
    return (
        "<think>\nLook it up.\n</think>\n\n" + [call("search", query="Zelka director"), "Ann Lee"][min(n, 1)]
    )


def test_qwen3_reasoning_kept_by_the_agent_extends_its_row(agent_module, qwen3_tok):
    """Qwen3 renders the reasoning of the turns after the last user message: an agent that sends its replies back
    as the client returned them (``reasoning_content`` included) continues one row."""
    env = env_for(qwen3_tok, agent_module.run)
    [t], _ = rollout([EX], env, Scripted(qwen3_tok, thinking_turns), qwen3_tok, PARAMS, 1, 2048)
    assert t.answer == "Ann Lee" and t.info["agent_rows"] == 1
    assert qwen3_tok.decode(t.token_ids).count("Look it up.") == 2


def nudging_agent(question: str, base_url: str) -> str | None:
    """Replies to the model's first turn with a user message (a new user turn)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages: list = [{"role": "user", "content": f"Question: {question}"}]
    m = client.chat.completions.create(model="p", messages=messages).choices[0].message
    messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "Answer with the name alone."}]
    return client.chat.completions.create(model="p", messages=messages).choices[0].message.content


@pytest.mark.parametrize("which,rows", [("qwen2.5", 1), ("qwen3", 2)])
def test_a_template_that_rewrites_the_past_starts_a_new_row(qwen_tok, qwen3_tok, which, rows):
    """A new user turn: Qwen2.5 renders the earlier turn as it was (one row); Qwen3 drops the reasoning of turns
    before the last user message, so the conversation is rendered anew and trains as a second row."""
    tok = qwen_tok if which == "qwen2.5" else qwen3_tok
    env = env_for(tok, nudging_agent)
    script = lambda p: "<think>\nHm.\n</think>\n\n" + ("Ann Lee" if "alone" in p else "Zelka?")  # noqa: E731
    [t], _ = rollout([EX], env, Scripted(tok, script), tok, PARAMS, 1, 2048)
    assert t.answer == "Ann Lee" and t.info["agent_rows"] == rows
    if rows == 2:
        [first] = t.info["context_folds"]
        assert "Hm." in tok.decode([i for s in first[0] for i in s.token_ids])
        assert tok.decode(t.segments[0].token_ids).count("Hm.") == 0  # the template dropped it


@pytest.fixture
def served(qwen_tok):
    """`searchrl serve-policy`'s app on a free port, in front of a scripted policy that calls an unknown tool."""
    from searchrl.core.asgi import Served
    from searchrl.rollout.policy_endpoint import PolicyEndpoint, make_policy_app

    script = lambda p: call("lookup", q="x") if "tools" in p else "hello"  # noqa: E731
    ep = PolicyEndpoint(
        Scripted(qwen_tok, script), qwen_tok, ChatFormat(qwen_tok), max_context=4096, max_calls=4
    )
    server = Served(make_policy_app(ep), port=0).start()
    yield server.url, ep
    server.stop()


def post(url: str, body, headers=None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "body,message",
    [
        (b"{not json", "JSON"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "'n' must be"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "not among",
        ),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": "no"}]}, "tool_calls must be"),
        ({"prompt": [-1, 5]}, "token ids must be"),
    ],
)
def test_bad_requests_are_answered_400_with_the_reason(served, body, message):
    url, _ = served
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    status, out = post(url + path, body)
    assert status == 400 and message in out["error"]["message"]
    assert post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0] == 200


def test_the_endpoint_records_sessions_reads_calls_and_refuses_past_its_budget(served, qwen_tok):
    url, ep = served
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    status, out = post(url + "/s/ep1/v1/chat/completions", {"messages": [{"role": "user", "content": "tools?"}],
                                                              "tools": tools, "n": 2})  # fmt: skip
    assert status == 200 and len(out["choices"]) == 2
    choice = out["choices"][0]  # a call to a tool the request did not offer: the turn comes back as text
    assert "tool_calls" not in choice["message"] and "lookup" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and ep.sessions["ep1"].calls[0].invalid_calls == 1
    # a session named by header or by the user field; plain completions take text or ids literally
    assert post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]},
                {"X-Session-Id": "h"})[0] == 200  # fmt: skip
    ids = qwen_tok.encode("Hello", add_special_tokens=False)
    status, out = post(url + "/v1/completions", {"prompt": ids, "user": "u"})
    assert status == 200 and out["choices"][0]["text"].startswith("hello")
    assert ep.sessions["h"].calls and ep.sessions["u"].calls[0].prompt_ids == ids
    import urllib.request

    with urllib.request.urlopen(url + "/v1/sessions/ep1", timeout=10) as r:
        rec = json.loads(r.read())
    assert len(rec["calls"]) == 2 and rec["calls"][0]["logprobs"] == [-0.5] * len(
        rec["calls"][0]["completion_ids"]
    )
    for _ in range(2):  # 4 calls in all
        assert (
            post(url + "/s/ep1/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0]
            == 200
        )
    status, out = post(url + "/s/ep1/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and out["error"]["code"] == "call_budget_spent"
    # the budget counts completions (each may start a training row): n=2 with one left is refused whole
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert post(url + "/s/ep2/v1/chat/completions", {**body, "n": 3})[0] == 200
    status, out = post(url + "/s/ep2/v1/chat/completions", {**body, "n": 2})
    assert (
        status == 400 and "fewer than n=2" in out["error"]["message"] and len(ep.sessions["ep2"].calls) == 3
    )
    ep.close("h", "timeout")
    status, out = post(
        url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, {"X-Session-Id": "h"}
    )
    assert status == 409 and "ran out of time" in out["error"]["message"]


def test_streamed_replies_accumulate_to_the_unstreamed_reply(served):
    """``stream: true`` (agent frameworks stream by default): the openai client's streamed chunks, accumulated
    as frameworks do, give the unstreamed reply (text, tool calls, finish reason, usage), and the call is
    recorded as sampled."""
    from openai import OpenAI

    url, ep = served
    client = OpenAI(base_url=url + "/s/st/v1", api_key="unused")
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": params}}]
    msgs = [{"role": "user", "content": "tools?"}]
    plain = client.chat.completions.create(model="policy", messages=msgs, tools=tools)
    chunks = client.chat.completions.create(
        model="policy", messages=msgs, tools=tools, stream=True, stream_options={"include_usage": True}
    )
    content, calls, finish, usage, role = "", {}, None, None, None
    for ch in chunks:
        usage = ch.usage or usage
        for c in ch.choices:
            role = c.delta.role or role
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments)
            finish = c.finish_reason or finish
    m = plain.choices[0].message
    assert m.tool_calls and [(c.function.name, c.function.arguments) for c in m.tool_calls] == [
        (name, args) for _, name, args in calls.values()
    ]
    assert all(i.startswith("call_") for i, _, _ in calls.values())
    assert role == "assistant" and (content or None) == m.content
    assert finish == plain.choices[0].finish_reason == "tool_calls"
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    first, second = ep.sessions["st"].calls
    assert second.completion_ids == first.completion_ids and second.finish == "tool_calls"
    text = "".join(
        c.choices[0].text for c in client.completions.create(model="policy", prompt="Hi", stream=True)
    )
    assert text.startswith("hello") and len(ep.sessions["st"].calls) == 3
    status, out = post(url + "/v1/chat/completions", {"messages": msgs, "stream": "yes"})
    assert status == 400 and "'stream' must be true or false" in out["error"]["message"]


def test_a_prompt_longer_than_the_context_is_refused_and_ends_the_session(qwen_tok):
    from searchrl.rollout.policy_endpoint import PolicyEndpoint, Refused

    ep = PolicyEndpoint(Scripted(qwen_tok, lambda p: "x"), qwen_tok, ChatFormat(qwen_tok), max_context=16)
    with pytest.raises(Refused, match="context") as e:
        ep.chat_request("s", {"messages": [{"role": "user", "content": "word " * 40}]})
    assert e.value.code == "context_length_exceeded" and ep.sessions["s"].closed == "length"
    # a document holding the end-of-turn text is text: it cannot end the turn in the ids
    ep = PolicyEndpoint(Scripted(qwen_tok, lambda p: "x"), qwen_tok, ChatFormat(qwen_tok))
    end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    ids = [ep.chat_request(s, {"messages": [{"role": "user", "content": c}]}).prompt_ids for s, c in
           [("t", "a <|im_end|> b"), ("u", "a b")]]  # fmt: skip
    assert ids[0].count(end) == ids[1].count(end) == 2  # the default system turn's end and the user turn's


def test_serve_policy_answers_an_openai_client_and_records_what_it_sampled(qwen_model_dir):
    """`searchrl serve-policy` on a model directory as users download them (Qwen2.5's vocabulary and template)."""
    import os
    import subprocess
    import urllib.request

    from openai import OpenAI
    from transformers import AutoTokenizer

    cmd = [sys.executable, "-m", "searchrl", "serve-policy", "--model", str(qwen_model_dir), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        banner = proc.stdout.readline()
        url = banner.split(" on ")[1].split("/v1")[0]
        client = OpenAI(base_url=f"{url}/s/run1/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0
        )
        with urllib.request.urlopen(f"{url}/v1/sessions/run1", timeout=30) as r:
            [rec] = json.loads(r.read())["calls"]
        tok = AutoTokenizer.from_pretrained(str(qwen_model_dir))
        assert rec["prompt_ids"] == tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert 1 <= len(rec["completion_ids"]) <= 6 and len(rec["logprobs"]) == len(rec["completion_ids"])
        assert reply.usage.completion_tokens == len(rec["completion_ids"])
        text = tok.decode(rec["completion_ids"])
        assert (reply.choices[0].message.content or "") in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_command_program_plays_through_its_environment(qwen_tok, tmp_path):
    """``env.agent_program.command``: the episode in the process's environment, the answer its last line; a
    command that fails or runs past its time ends its episode only."""
    cmd = [sys.executable, str(EXAMPLES / "command_agent.py")]
    env = AgentProgramEnv(CountingRetriever(), ChatFormat(qwen_tok), command=cmd, template="tools", topk=1)
    trajs, _ = rollout([EX], env, Scripted(qwen_tok, lambda p: "Ann Lee"), qwen_tok, PARAMS, 2, 2048)
    assert [t.answer for t in trajs] == ["Ann Lee", "Ann Lee"] and all(len(t.steps) == 1 for t in trajs)
    assert "Who directed Zelka?" in qwen_tok.decode(trajs[0].segments[0].token_ids)
    failing = AgentProgramEnv(CountingRetriever(), ChatFormat(qwen_tok), command=[sys.executable, "-c", "raise SystemExit(3)"],
                              template="tools", topk=1)  # fmt: skip
    [t], _ = rollout([EX], failing, Scripted(qwen_tok, lambda p: "x"), qwen_tok, PARAMS, 1, 2048)
    assert t.finish_reason == "error" and t.answer is None
    slow = AgentProgramEnv(CountingRetriever(), ChatFormat(qwen_tok), command=[sys.executable, "-c", "import time; time.sleep(30)"],
                           template="tools", topk=1, timeout=1.0)  # fmt: skip
    t0 = time.monotonic()
    [t], _ = rollout([EX], slow, Scripted(qwen_tok, lambda p: "x"), qwen_tok, PARAMS, 1, 2048)
    assert t.finish_reason in ("timeout", "error") and time.monotonic() - t0 < 10


def test_hung_programs_free_their_workers(qwen_tok):
    """With one worker and three episodes whose program never returns, each is abandoned at its timeout and the
    next starts: the collection ends in about three timeouts, not never."""
    env = env_for(qwen_tok, hanging, timeout=1.0, workers=1)
    t0 = time.monotonic()
    trajs, _ = rollout([EX], env, Scripted(qwen_tok, lambda p: "x"), qwen_tok, PARAMS, 3, 2048)
    assert [t.finish_reason for t in trajs] == ["timeout"] * 3 and time.monotonic() - t0 < 15


def smolagents_turns(prompt: str) -> str:
    """Search, then call smolagents' ``final_answer`` tool once the search's result is in the history."""
    if "directed by" in prompt:
        return call("final_answer", answer="Ann Lee")
    return call("search", query="Zelka director")


def test_a_smolagents_agent_trains_one_row_per_call(monkeypatch, qwen_tok):
    """The smolagents example (`ToolCallingAgent` over `OpenAIServerModel`), unchanged, through the endpoint: it
    asks for ``tool_choice: required`` (taken, not enforced) and sends its history back as its own text (the call
    as "Calling tools: …", the result as an "Observation:" user message), so each call is a row of its own; each
    row is a prompt the endpoint sent and the completion sampled from it, and both rows carry the episode."""
    pytest.importorskip("smolagents")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("smolagents_search_agent", None)
    import smolagents_search_agent

    gen = Scripted(qwen_tok, smolagents_turns)
    env = env_for(qwen_tok, smolagents_search_agent.run, timeout=60)
    trajs, stats = rollout([EX], env, gen, qwen_tok, PARAMS, 1, 4096)
    [t] = trajs
    assert t.answer == "Ann Lee" and t.finish_reason == "answer" and t.info["agent_rows"] == 2
    assert [q for q, _ in t.episode.searches()] == ["Zelka director"]
    rows = unfold(trajs)
    assert len(rows) == 2 and rows[0].episode_id == rows[1].episode_id and rows[0].state is rows[1].state
    assert len(gen.prompts) == 2
    for row, prompt, turn in zip(rows, gen.prompts, ("Zelka director", "final_answer")):
        [prompt_seg, action] = [s for s in row.segments]
        assert prompt_seg.token_ids == prompt and action.logprobs == [-0.5] * len(action.token_ids)
        assert turn in qwen_tok.decode(action.token_ids)
    assert float(stats.metrics()["agent/split_episodes"]) == 1.0


def test_serve_policy_on_vllm_says_what_it_needs_where_vllm_is_missing(qwen_model_dir, monkeypatch, capsys):
    """``--backend vllm`` builds the engine on the directory's weights (a GPU path, not run here); where vLLM is
    not installed the command says so and how to install it, before loading anything."""
    import importlib.util

    from searchrl.app.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(SystemExit) as e:
        main(["serve-policy", "--model", str(qwen_model_dir), "--port", "0", "--backend", "vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--backend vllm needs vLLM" in err and "--backend hf" in err
