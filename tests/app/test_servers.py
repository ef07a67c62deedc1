"""`serve-retriever` and `serve-model` on Starlette/uvicorn: limits, a JSON error for every bad request,
timeouts, /health, concurrent requests batched into one call; and the clients' errors."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

import pytest

from searchrl.app.chat_server import make_chat_server
from searchrl.data.corpus import load_corpus
from searchrl.envs.retrievers.bm25 import BM25Retriever
from searchrl.envs.retrievers.http import HTTPRetriever, RetrieverUnavailable, make_server
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.chat import LocalChat
from tests.helpers import JSONHandler


def call(url, body=None, method="POST", raw=None):
    """(status, decoded JSON) of one request; every answer must be JSON."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Slow:
    """A retriever that takes ``delay`` seconds per call and counts its calls."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.calls = inner, delay, 0

    def search(self, queries, k):
        self.calls += 1
        time.sleep(self.delay)
        return self.inner.search(queries, k)


@pytest.fixture(scope="module")
def bm25(fixtures):
    return BM25Retriever(load_corpus(fixtures / "corpus.jsonl"))


@pytest.fixture
def retrieval(bm25):
    server = make_server(
        bm25, "127.0.0.1", 0, max_queries=8, max_query_chars=100, max_body_bytes=4096
    ).start()
    yield server.url
    server.stop()


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"queries": ["x"] * 9}, 400, "at most 8"),
        ({"queries": ["x" * 101]}, 400, "longer than 100"),
        ({"queries": ["x"], "topk": -1}, 400, "'topk' must be an integer from 1 to 100"),
        ({"queries": ["x"], "topk": 1.5}, 400, "'topk'"),
        ({"queries": ["x"], "topk": True}, 400, "'topk'"),
        ({"queries": ["x"], "topk": 101}, 400, "'topk'"),
        ({"queries": "x"}, 400, "list of strings"),
        ({"topk": 3}, 400, "list of strings"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_retriever_bad_requests_get_json_errors(retrieval, body, status, message):
    code, answer = call(retrieval + "/retrieve", body)
    assert code == status and message in answer["error"], answer


def test_retriever_limits_nesting_paths_and_health(retrieval):
    assert call(retrieval + "/retrieve", raw=b'{"queries": ["x"], "topk": Infinity}')[0] == 400
    code, answer = call(retrieval + "/retrieve", raw=b"[" * 2000 + b"]" * 2000)  # under the body limit
    assert code == 400 and "not JSON" in answer["error"]
    code, answer = call(retrieval + "/retrieve", raw=json.dumps({"queries": ["x" * 90] * 60}).encode())
    assert code == 413 and "4096 bytes" in answer["error"]
    assert call(retrieval + "/nope", {"queries": []})[0] == 404
    assert call(retrieval + "/retrieve", method="GET")[0] == 405
    assert call(retrieval + "/retrieve", {"queries": []}) == (200, {"result": []})
    code, health = call(retrieval + "/health", method="GET")
    assert code == 200 and health["status"] == "ok"


def test_concurrent_requests_are_batched_into_one_retriever_call(bm25):
    slow = Slow(bm25, 0.2)
    server = make_server(slow, "127.0.0.1", 0).start()
    queries = [f"capital of France {i}" for i in range(32)]
    try:
        with ThreadPoolExecutor(32) as pool:
            answers = list(
                pool.map(lambda q: call(server.url + "/retrieve", {"queries": [q], "topk": 2}), queries)
            )
    finally:
        server.stop()
    assert all(code == 200 for code, _ in answers)
    expected = bm25.search(queries, 2)
    assert [[d["id"] for d in a["result"][0]] for _, a in answers] == [
        [d.id for d in row] for row in expected
    ]
    assert slow.calls <= 6  # one call per wave of waiting requests, not 32


def test_retriever_timeout_and_unequal_topk_in_one_batch(bm25):
    server = make_server(Slow(bm25, 1.0), "127.0.0.1", 0, timeout=0.3).start()
    try:
        code, answer = call(server.url + "/retrieve", {"queries": ["x"]})
    finally:
        server.stop()
    assert code == 504 and "timeout (0.3 s)" in answer["error"]
    server = make_server(Slow(bm25, 0.2), "127.0.0.1", 0).start()
    try:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(
                lambda k: call(server.url + "/retrieve", {"queries": ["capital of France"], "topk": k}),
                (1, 2),
            )
    finally:
        server.stop()
    assert len(a[1]["result"][0]) == 1 and len(b[1]["result"][0]) == 2


def test_model_server_caps_and_refuses(tiny_model_dir):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    server = make_chat_server(LocalChat(model, tok), "tiny", "127.0.0.1", 0, max_tokens=4).start()
    url = server.url + "/v1/chat/completions"
    hello = [{"role": "user", "content": "Hello"}]
    try:
        t = time.perf_counter()
        code, reply = call(url, {"messages": hello, "max_tokens": 5000})  # capped to the server's 4
        assert code == 200 and time.perf_counter() - t < 20
        assert len(tok(reply["choices"][0]["message"]["content"], add_special_tokens=False)["input_ids"]) <= 4
        for body, message in (
            ({"messages": hello, "max_tokens": 0}, "'max_tokens' must be an integer from 1"),
            ({"messages": [{"content": "hi"}]}, "messages[0] must be {role"),
            ({"messages": hello, "temperature": "hot"}, "'temperature'"),
            ({"messages": []}, "non-empty list"),
        ):
            code, answer = call(url, body)
            assert code == 400 and message in answer["error"]["message"], answer
        assert call(server.url + "/v1/models", method="GET")[1]["data"][0]["id"] == "tiny"
        assert call(server.url + "/health", method="GET")[1]["max_tokens"] == 4
    finally:
        server.stop()


def scripted(status, payload):
    class Handler(JSONHandler):
        def do_POST(self):
            self.read_json()
            self.reply(status, payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/retrieve"


@pytest.mark.parametrize(
    "status, payload, message, not_in",
    [
        (500, {"error": "index shard missing"}, "HTTP 500 (index shard missing)", "Is it running"),
        (
            400,
            {"error": "bad request: 'topk' must be an integer"},
            "HTTP 400 (bad request: 'topk' must be",
            "Is it running",
        ),
        (200, {"result": "nope"}, "unexpected shape", "Is it running"),
        (200, {"documents": []}, "unexpected shape (KeyError", "Is it running"),
    ],
)
def test_http_retriever_client_errors(status, payload, message, not_in):
    server, url = scripted(status, payload)
    try:
        with pytest.raises(RetrieverUnavailable) as e:
            HTTPRetriever(url, timeout=5, retries=1, backoff=0.01, retry_budget_s=0).search(["x"], 1)
    finally:
        server.shutdown()
        server.server_close()
    assert message in str(e.value) and not_in not in str(e.value), str(e.value)


def test_connections_that_never_send_a_whole_request_are_closed(bm25):
    """Slowloris: 50 connections that open, or send half a request head, and stall are closed after the
    head timeout, and the server answers a normal request meanwhile and after."""
    import socket

    from searchrl.core.asgi import Served
    from searchrl.envs.retrievers.http import make_app

    server = Served(make_app(bm25), "127.0.0.1", 0, head_timeout=0.5).start()
    try:
        stalled = []
        for i in range(50):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            if i % 2:
                s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")  # half a head, never finished
            stalled.append(s)
        status, body = call(f"{server.url}/retrieve", {"queries": ["Paris"], "topk": 1})
        assert status == 200 and body["result"]
        time.sleep(1.5)
        for s in stalled:
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the server
            s.close()
        assert call(f"{server.url}/retrieve", {"queries": ["Paris"], "topk": 1})[0] == 200
        # a kept-alive connection that starts a second request and stalls is closed too
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        body = json.dumps({"queries": ["Paris"], "topk": 1}).encode()
        s.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHo")
        time.sleep(1.5)
        assert s.recv(100) == b""
        s.close()
    finally:
        server.stop()


def test_a_run_outlives_a_retrieval_server_restarted_on_the_same_port(fixtures, tmp_path):
    """A real `serve-retriever` killed and started again on its port: a search made while it is down waits
    for it (the client's backoff) and succeeds; one made when it stays down stops with the URL named."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "searchrl",
        "serve-retriever",
        "--corpus",
        str(fixtures / "corpus.jsonl"),
        "--port",
        str(port),
    ]

    def start():
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    return proc
            except OSError:
                time.sleep(0.1)
        raise AssertionError("serve-retriever did not start")

    client = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=5, retries=6, backoff=0.5)
    server = start()
    try:
        assert client.search(["Paris"], 1)[0]
        server.kill()
        server.wait()
        restarted: list = []
        timer = threading.Timer(1.5, lambda: restarted.append(start()))
        timer.start()
        assert client.search(["Paris"], 1)[0]  # retried through the restart
        timer.join()
        server = restarted[0]
    finally:
        server.kill()
        server.wait()
    gone = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=1, retries=1, backoff=0.1, retry_budget_s=0)
    with pytest.raises(
        RetrieverUnavailable, match=f"127.0.0.1:{port}/retrieve did not answer after 2 attempts"
    ):
        gone.search(["Paris"], 1)
    # down for longer than one round of retries: waited for within retry_budget_s, each wait a warning
    patient = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=1, retries=1, backoff=0.1, retry_budget_s=60)
    with pytest.raises(RetrieverUnavailable, match="did not answer"):
        patient.check()  # before a run's first step: no waiting
    restarted = []
    timer = threading.Timer(4.0, lambda: restarted.append(start()))
    timer.start()
    try:
        assert patient.search(["Paris"], 1)[0]
    finally:
        timer.join()
        restarted[0].kill()
        restarted[0].wait()
    short = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=1, retries=0, backoff=0.1, retry_budget_s=1)
    with pytest.raises(RetrieverUnavailable, match="waited 1 s for it: env.retriever.args.retry_budget_s"):
        short.search(["Paris"], 1)


def test_clients_that_disconnect_mid_body_leave_one_line_each(bm25):
    """A client that announces a body and hangs up halfway: the server logs one line per such request (no
    traceback), and answers the next client."""
    import logging
    import socket

    from searchrl.core.asgi import Served
    from searchrl.envs.retrievers.http import make_app

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    server = Served(make_app(bm25), "127.0.0.1", 0).start()
    handler = Keep()  # after the start: uvicorn's logging set-up replaces its loggers' handlers
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(
                b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"queries": ["Par'
            )
            time.sleep(0.1)
            s.close()
        assert call(f"{server.url}/retrieve", {"queries": ["Paris"], "topk": 1})[0] == 200
        deadline = time.monotonic() + 10
        while len(lines) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
        logger.removeHandler(handler)
    assert len(lines) == 5, lines
    assert all("disconnected after 17 bytes" in x and "POST /retrieve" in x for x in lines), lines
    assert not any("Traceback" in x or "\n" in x for x in lines), lines


def test_a_body_that_never_arrives_is_answered_408_within_the_bound(bm25):
    """A client that sends its head with `Content-Length: 100` and 10 bytes of body, then nothing: answered
    408 when ``body_timeout`` passes and closed, one log line, while other clients are served (it was held
    open indefinitely: one over 400 s, 300 at once over 90 s)."""
    import socket

    from searchrl.core.asgi import Served
    from searchrl.envs.retrievers.http import make_app

    server = Served(make_app(bm25), "127.0.0.1", 0, body_timeout=1.0).start()
    try:
        held = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(
                b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"queries"'
            )
            held.append(s)
        t = time.monotonic()
        assert call(f"{server.url}/retrieve", {"queries": ["Paris"], "topk": 1})[0] == 200
        for s in held:
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in got, got[:200]
            s.close()
        assert time.monotonic() - t < 8
    finally:
        server.stop()


def test_a_run_checks_its_retrieval_server_before_the_first_step(make_exp, tmp_path):
    """A retrieval server that is not up (or a wrong URL): the run stops before its first step, at once, not
    after minutes of retries and waiting (`retry_budget_s` applies to a server lost mid-run)."""
    import socket

    from searchrl.core.config import TrainerConfig
    from tests.engine.test_trainer import trainer_for

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exp = make_exp(
        f"env.retriever={{name: http, args: {{url: 'http://127.0.0.1:{port}', retries: 1, backoff: 0.05}}}}"
    )
    tr = trainer_for(
        exp,
        "grpo",
        TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, save_every=10**6),
        out=tmp_path / "r",
    )
    t = time.monotonic()
    with pytest.raises(
        RetrieverUnavailable, match=f"127.0.0.1:{port}/retrieve did not answer after 2 attempts"
    ):
        tr.run()
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert time.monotonic() - t < 10 and (
        not metrics.exists() or not metrics.read_text().strip()
    )  # no step ran
