"""Client and server for Search-R1's retrieval-server protocol.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (without scores: a list of
documents per query). Any Search-R1 / FlashRAG-style server works with the client, and
``searchrl serve-retriever`` serves any of our retrievers the same way.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from searchrl.data.corpus import Doc
from searchrl.envs.retrievers.base import Retriever
from searchrl.errors import SearchRLError


class RetrieverUnavailable(SearchRLError, ConnectionError):
    pass


class HTTPRetriever:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8000/retrieve",
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(
                    self.url, data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    payload = json.loads(resp.read())
                return [[_parse_doc(item) for item in row] for row in payload["result"]]
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # a client error will not go away by retrying
                    raise RetrieverUnavailable(
                        f"retrieval server {self.url} rejected the request: HTTP {exc.code}"
                    ) from exc
                last = exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = exc
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RetrieverUnavailable(
            f"retrieval server {self.url} did not answer after {self.retries + 1} attempts ({last}). "
            "Is it running? Start one with `searchrl serve-retriever --retriever bm25 --corpus CORPUS`."
        )


def _parse_doc(item: dict[str, Any]) -> Doc:
    doc, score = (item["document"], float(item.get("score", 0.0))) if "document" in item else (item, 0.0)
    if "contents" in doc:
        return Doc.from_contents(str(doc.get("id", "")), doc["contents"], score)
    return Doc(id=str(doc.get("id", "")), title=doc.get("title", ""), text=doc.get("text", ""), score=score)


class _Handler(BaseHTTPRequestHandler):
    retriever: Retriever
    lock: threading.Lock

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default
        pass

    def _reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/retrieve":
            self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
            return
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            queries, topk = req["queries"], int(req.get("topk", 3))
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise ValueError("'queries' must be a list of strings")
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": f"bad request: {exc}"})
            return
        with self.lock:  # retrievers are not assumed thread-safe
            results = self.retriever.search(queries, topk)
        body: list[list[dict[str, Any]]]
        if req.get("return_scores", False):
            body = [[{"document": d.to_json(), "score": d.score} for d in row] for row in results]
        else:
            body = [[d.to_json() for d in row] for row in results]
        self._reply(200, {"result": body})


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``retriever`` (not started). Port 0 picks a free port."""
    handler = type("Handler", (_Handler,), {"retriever": retriever, "lock": threading.Lock()})
    return ThreadingHTTPServer((host, port), handler)
