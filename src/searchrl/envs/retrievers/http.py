"""Client and server for Search-R1's retrieval-server protocol.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (without scores: a list of
documents per query). Any Search-R1 / FlashRAG-style server works with the client, and
``searchrl serve-retriever`` serves any of our retrievers the same way.
"""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer
from typing import Any

from searchrl.data.corpus import Doc
from searchrl.envs.retrievers.base import Retriever
from searchrl.errors import SearchRLError
from searchrl.serving import JSONHandler, ServiceError, post_json


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
        try:
            payload = post_json(self.url, {"queries": queries, "topk": k, "return_scores": True}, self.timeout,
                                self.retries, self.backoff)  # fmt: skip
        except ServiceError as exc:
            hint = (
                ""
                if exc.status
                else (
                    " Is it running? Start one with `searchrl serve-retriever --retriever bm25 --corpus CORPUS`."
                )
            )
            raise RetrieverUnavailable(f"retrieval server: {exc}.{hint}") from None
        return [[_parse_doc(item) for item in row] for row in payload["result"]]


def _parse_doc(item: dict[str, Any]) -> Doc:
    doc, score = (item["document"], float(item.get("score", 0.0))) if "document" in item else (item, 0.0)
    if "contents" in doc:
        return Doc.from_contents(str(doc.get("id", "")), doc["contents"], score)
    return Doc(id=str(doc.get("id", "")), title=doc.get("title", ""), text=doc.get("text", ""), score=score)


class _Handler(JSONHandler):
    retriever: Retriever
    lock: threading.Lock

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/retrieve":
            self.reply(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
            return
        try:
            req = self.read_json()
            queries, topk = req["queries"], int(req.get("topk", 3))
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise ValueError("'queries' must be a list of strings")
        except (ValueError, KeyError, TypeError) as exc:
            self.reply(400, {"error": f"bad request: {exc}"})
            return
        with self.lock:  # retrievers are not assumed thread-safe
            results = self.retriever.search(queries, topk)
        body: list[list[dict[str, Any]]]
        if req.get("return_scores", False):
            body = [[{"document": d.to_json(), "score": d.score} for d in row] for row in results]
        else:
            body = [[d.to_json() for d in row] for row in results]
        self.reply(200, {"result": body})


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server for ``retriever`` (not started). Port 0 picks a free port."""
    handler = type("Handler", (_Handler,), {"retriever": retriever, "lock": threading.Lock()})
    return ThreadingHTTPServer((host, port), handler)
