"""No key on disk or on the console: a key in a config is refused (never echoed or written), and whatever
an endpoint echoes back (its 401 body quoting the Authorization header) is redacted before it is shown."""

import threading
from http.server import ThreadingHTTPServer

import pytest

from searchrl.app.cli import main
from searchrl.core.serving import redact
from tests.helpers import QUICKSTART, JSONHandler

CANARY = "sk-canary0123456789abcdefXYZ"


class Echo401(JSONHandler):
    """An endpoint that rejects the key and quotes it back, as some providers do."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        auth = self.headers.get("Authorization", "")
        self.reply(401, {"error": {"message": f"Incorrect API key provided: {auth}. key={auth[7:]}"}})


class NoScore(JSONHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(200, {"choices": [{"message": {"role": "assistant", "content": "I think it is fine."}}]})


def serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def everything_under(root):
    return "".join(p.read_bytes().decode("utf-8", "replace") for p in root.rglob("*") if p.is_file())


def test_redact():
    assert redact(f"bad key Bearer {CANARY}!", [f"Bearer {CANARY}"]) == "bad key [redacted]!"
    assert CANARY not in redact(f'{{"api_key": "{CANARY}"}}')
    assert redact("my-own-secret in text", ["my-own-secret"]) == "[redacted] in text"


@pytest.mark.parametrize(
    "override",
    [f"algorithm.judge_args.api_key={CANARY}", f"algorithm.judge_args.url=http://x/v1?key={CANARY}"],
)
def test_a_key_in_the_config_is_refused_unseen_and_unwritten(tmp_path, capsys, override):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", str(QUICKSTART), f"output_dir={out}", "algorithm={name: slate, judge: llm}", override])
    printed = capsys.readouterr()
    assert e.value.code == 2 and "Traceback" not in printed.err
    assert "secret" in printed.err and "api_key_env" in printed.err
    assert CANARY not in printed.out + printed.err
    assert not out.exists() or CANARY not in everything_under(out)


def test_a_run_whose_judge_echoes_the_key_writes_and_prints_no_key(
    tmp_path, capsys, monkeypatch, world_dir, agent_model_dir
):
    server, url = serve(Echo401)
    monkeypatch.setenv("CANARY_JUDGE_KEY", CANARY)
    out = tmp_path / "run"
    judge = (
        f"{{backend: openai, model: m, url: '{url}', api_key_env: CANARY_JUDGE_KEY, retries: 0, timeout: 5}}"
    )
    try:
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "train",
                    str(QUICKSTART),
                    f"output_dir={out}",
                    f"data.world_dir={world_dir}",
                    f"warm_start.checkpoint={agent_model_dir}",
                    f"algorithm={{name: slate, k: 2, judge: llm, judge_args: {judge}}}",
                    "trainer={steps: 2, batch_size: 2, micro_batch_size: 8, lr: 1.0e-4, save_every: 1}",
                    "rollout.max_new_tokens=16",
                    "eval.limit=2",
                ]
            )
    finally:
        server.shutdown()
        server.server_close()
    printed = capsys.readouterr()
    assert e.value.code == 2, printed.err[-2000:]
    assert "HTTP 401" in printed.err and "[redacted]" in printed.err  # the error is shown, the key is not
    assert CANARY not in printed.out + printed.err
    assert CANARY not in everything_under(out)  # config.yaml, metrics.jsonl, guards, checkpoints, logs


def test_judge_replies_without_a_score_count_as_failures(monkeypatch):
    from types import SimpleNamespace

    from searchrl.core.serving import ServiceFailure, check_failure_rates, failure_summary, service_metrics
    from searchrl.rewards.llm_judge import LLMJudge

    server, url = serve(NoScore)
    try:
        judge = LLMJudge(backend="openai", url=url, model="m", workers=2, max_failure_rate=0.05)
        st = SimpleNamespace(
            actions=[], observations=[], example=SimpleNamespace(question="q?", answers=("a",))
        )
        info = SimpleNamespace(kind="answer", valid=True, answer="a", query=None)
        items = [
            SimpleNamespace(
                prefix=st, action="<think> t </think><answer> a </answer>", info=info, retrieved=()
            )
        ] * 12
        service_metrics()  # earlier tests' counters: start from here
        scores = judge(items)
    finally:
        server.shutdown()
        server.server_close()
    assert all(s.failed for s in scores)
    assert (judge.client.counter.requests, judge.client.counter.failures) == (24, 24)  # think + answer each
    assert any("24 requests, 24 failed (100.0%)" in line for line in failure_summary())
    totals = {k: float(v.value) if hasattr(v, "value") else float(v) for k, v in service_metrics().items()}
    with pytest.raises(ServiceFailure, match="had no <score>"):
        check_failure_rates(totals)
