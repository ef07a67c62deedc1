"""The LLM judge: score parsing, the OpenAI-compatible backend against real local servers (the tiny model
served by `searchrl serve-model`'s server, and a scripted one), failures, and the local HF backend."""

import json
import threading

import pytest

from searchrl.app.chat_server import make_chat_server
from searchrl.core.serving import ServiceError, post_json
from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rewards.judges import JudgeItem
from searchrl.rewards.llm_judge import LLMJudge, parse_score
from searchrl.rollout.chat import LocalChat
from tests.helpers import JSONHandler


@pytest.mark.parametrize(
    "text, score",
    [
        ("reasoning... <score>1</score>", 1.0),
        ("<score> -1 </score>", -1.0),
        ("<SCORE>+1</SCORE>", 1.0),
        ("first <score>0</score> then <score>1</score>", 1.0),
        ("<score>1.0</score>", 1.0),
        ("Final score: -1", -1.0),
        ("**Score**: 0", 0.0),
        ("no verdict", None),
        ("<score>5</score>", None),
        ("", None),
    ],
)
def test_parse_score(text, score):
    assert parse_score(text) == score


@pytest.fixture
def items(world_bm25, small_world):
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=3)
    ex = small_world.examples("train")[0]
    prefix = env.reset(ex)
    out = []
    for action in (
        f"<think> need {ex.hops[0].gold_title} </think>\n<search> {ex.hops[0].keys[0]} </search>",
        f"<think> done </think>\n<answer> {ex.answers[0]} </answer>",
        "<think> x </think> garbage",
    ):
        st = env.reset(ex)
        env.step(st, action)
        out.append(JudgeItem(prefix, action, st.infos[-1], tuple(st.retrieved[-1])))
    return out


def serve(server):
    """A stdlib test server (scripted replies) in a thread; its /v1 address."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_endpoint_backend_against_the_tiny_model_server(items, tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    server = make_chat_server(LocalChat(model, tok), "tiny", "127.0.0.1", 0).start()
    url = server.url + "/v1"
    try:
        reply = post_json(
            url + "/chat/completions",
            {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]},
        )
        assert reply["object"] == "chat.completion" and reply["choices"][0]["finish_reason"] in (
            "stop",
            "length",
        )
        assert isinstance(reply["choices"][0]["message"]["content"], str)
        usage = reply["usage"]  # as OpenAI's: what was read and written, in tokens
        assert 0 < usage["completion_tokens"] <= 5 and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        with pytest.raises(ServiceError, match="HTTP 400"):
            post_json(url + "/chat/completions", {"messages": "not a list"}, retries=0)
        with pytest.raises(ServiceError, match="HTTP 400.*'stream': true is not supported"):
            body = {"stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            post_json(url + "/chat/completions", body, retries=0)
        scores = LLMJudge(backend="openai", url=url, model="tiny", max_tokens=8, timeout=30)(items)
    finally:
        server.stop()
    # the untrained tiny model writes no <score>: every request fails, scores 0, nothing crashes
    assert [s.failed for s in scores] == [True, True, True]
    assert scores[0].think == 0.0 and scores[0].query == 0.0 and scores[2].answer == -1.0


class Scripted(JSONHandler):
    seen: list

    def do_POST(self):
        req = self.read_json()
        self.seen.append((self.headers.get("Authorization"), req))
        prompt = req["messages"][-1]["content"]
        content = (
            "ok <score>1</score>"
            if "reasoning step" in prompt
            else "bad <score>-1</score>"
            if "search query" in prompt
            else "Score: 0"
        )
        self.reply(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})


def test_scores_are_routed_by_part_and_the_key_comes_from_the_environment(items, monkeypatch):
    from http.server import ThreadingHTTPServer

    seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Scripted,), {"seen": seen}))
    url = serve(server)
    monkeypatch.setenv("JUDGE_TEST_KEY", "s3cret")
    try:
        scores = LLMJudge(backend="openai", url=url, model="m", api_key_env="JUDGE_TEST_KEY", workers=2)(
            items
        )
    finally:
        server.shutdown()
        server.server_close()
    search, answer, garbage = scores
    assert (search.think, search.query, search.failed) == (1.0, -1.0, False)
    assert (answer.think, answer.answer, answer.failed) == (1.0, 0.0, False)
    assert (garbage.think, garbage.answer) == (1.0, -1.0)  # malformed: no request for its action part
    assert len(seen) == 5 and all(h == "Bearer s3cret" for h, _ in seen)
    assert all(json.dumps(r).find("s3cret") < 0 for _, r in seen)


def test_an_unreachable_endpoint_scores_zero_and_counts_failures(items):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scores = LLMJudge(backend="openai", url=f"http://127.0.0.1:{port}/v1", model="m", timeout=1, retries=0)(
        items
    )
    assert all(s.failed for s in scores) and scores[0].think == 0.0


def test_local_hf_backend_batches(items, tiny_model_dir):
    scores = LLMJudge(backend="hf", model=str(tiny_model_dir), max_tokens=4)(items)
    assert len(scores) == 3 and all(s.failed for s in scores)


def test_bad_judge_settings_are_clear():
    with pytest.raises(ValueError, match="backend must be 'hf' or 'openai'"):
        LLMJudge(backend="vllm", model="x")
    with pytest.raises(ValueError, match="judge_args.model is required"):
        LLMJudge(backend="openai")
