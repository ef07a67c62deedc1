"""Retrieval server benchmark: requests/s and errors of `searchrl serve-retriever` under concurrent clients,
against the in-process retriever on the same corpus.

    python benchmarks/retrieval_server.py                     # starts a BM25 server on the synthetic world
    python benchmarks/retrieval_server.py --url http://127.0.0.1:8000/retrieve --corpus CORPUS.jsonl

The server runs in its own process (`searchrl serve-retriever --corpus …`); the load comes from this one:
asyncio clients on keep-alive HTTP/1.1 connections, one per concurrent request stream, at concurrency 1, 16,
64 and 256 with single-query requests (the synthetic world's questions), then 64-query requests. An error
is any connection failure or a status other than 200. Written to benchmarks/results/retrieval_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]


async def _stream(host: str, port: int, path: str, bodies: list[bytes], deadline: float, out: dict) -> None:
    """One client connection sending ``bodies`` in turn until ``deadline``; reconnects after an error."""
    reader = writer = None
    i = 0
    while time.perf_counter() < deadline:
        body = bodies[i % len(bodies)]
        i += 1
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            writer.write(head + body)
            await writer.drain()
            assert reader is not None
            first = (await reader.readline()).split()
            status, close = int(first[1]), first[0] == b"HTTP/1.0"
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
                close |= name.lower() == b"connection" and value.strip().lower() == b"close"
            await reader.readexactly(length)
            out["ok" if status == 200 else "errors"] += 1
            if close:  # a server without keep-alive: a new connection for the next request
                writer.close()
                reader = writer = None
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            out["errors"] += 1
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


async def _load(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    u = urlparse(url)
    out = {"ok": 0, "errors": 0}
    deadline = time.perf_counter() + seconds
    t = time.perf_counter()
    await asyncio.gather(
        *(
            _stream(
                u.hostname or "127.0.0.1",
                u.port or 80,
                u.path,
                bodies[j::concurrency] or bodies,
                deadline,
                out,
            )
            for j in range(concurrency)
        )
    )
    dt = time.perf_counter() - t
    return {
        "concurrency": concurrency,
        "requests_per_s": out["ok"] / dt,
        "errors": out["errors"],
        "requests": out["ok"] + out["errors"],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen | None) -> None:
    import urllib.request

    deadline = time.time() + 120
    while True:
        try:
            req = urllib.request.Request(url, data=b'{"queries": ["x"], "topk": 1}', method="POST")
            urllib.request.urlopen(req, timeout=2).read()
            return
        except OSError:
            if time.time() > deadline or (proc is not None and proc.poll() is not None):
                raise SystemExit(f"the server at {url} did not come up") from None
            time.sleep(0.3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--corpus", help="corpus JSONL (default: the synthetic world's, generated)")
    p.add_argument("--seconds", type=float, default=5.0, help="per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--name", default="retrieval_server")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()

    from searchrl.data import load_corpus
    from searchrl.envs.retrievers import build_retriever
    from searchrl.envs.synthetic.world import World, WorldConfig

    scratch = Path(tempfile.mkdtemp(prefix="retrieval-server-"))
    world = World.generate(WorldConfig(seed=0))
    corpus = args.corpus or str(world.save(scratch / "world") / "corpus.jsonl")
    questions = [e.question for s in ("train", "dev", "test") for e in world.examples(s)]
    docs = load_corpus(corpus)

    local = build_retriever("bm25", corpus=docs, cache=0)
    t = time.perf_counter()
    for q in questions[:500]:
        local.search([q], 3)
    single = 500 / (time.perf_counter() - t)
    t = time.perf_counter()
    batches = [questions[i : i + 64] for i in range(0, 64 * 20, 64)]
    for b in batches:
        local.search(b, 3)
    batched = 64 * len(batches) / (time.perf_counter() - t)

    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}/retrieve"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "searchrl",
                "serve-retriever",
                "--corpus",
                corpus,
                "--port",
                str(port),
                "--arg",
                "method=lucene",
            ],
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    try:
        _wait(url, proc)
        one = [json.dumps({"queries": [q], "topk": 3}).encode() for q in questions]
        rows = []
        for c in args.concurrency:
            r = asyncio.run(_load(url, one, c, args.seconds))
            rows.append({**r, "queries_per_request": 1})
            print(
                f"concurrency {c:>3}, 1 query per request: {r['requests_per_s']:8.0f} requests/s, "
                f"{r['errors']} errors",
                flush=True,
            )
        many = [
            json.dumps({"queries": questions[i : i + 64], "topk": 3}).encode() for i in range(0, 64 * 20, 64)
        ]
        for c in (1, 4):
            r = asyncio.run(_load(url, many, c, args.seconds))
            rows.append({**r, "queries_per_request": 64, "queries_per_s": r["requests_per_s"] * 64})
            print(
                f"concurrency {c:>3}, 64 queries per request: {r['requests_per_s'] * 64:8.0f} queries/s, "
                f"{r['errors']} errors",
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    result = {
        "documents": len(docs),
        "in_process_queries_per_s": {"single": single, "batch_of_64": batched},
        "server": url if args.url else "searchrl serve-retriever (bm25)",
        "rows": rows,
        "cpu_count": os.cpu_count(),
        "note": "client and server on the same machine",
    }
    print(
        f"in process: {single:.0f} queries/s one at a time, {batched:.0f} queries/s in batches of 64 "
        f"({len(docs)} documents)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
