"""Client and server for Search-R1's retrieval-server protocol.

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (without scores: a list of
documents per query). Any Search-R1 / FlashRAG-style server works with the client, and
``searchrl serve-retriever`` serves any of our retrievers the same way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from searchrl.core.errors import SearchRLError
from searchrl.core.records import Doc
from searchrl.core.serving import ServiceError, post_json
from searchrl.envs.retrievers.protocol import Retriever

log = logging.getLogger(__name__)


class RetrieverUnavailable(SearchRLError, ConnectionError):
    pass


class HTTPRetriever:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8000/retrieve",
        timeout: float = 30.0,
        retries: int = 8,
        backoff: float = 0.5,
        retry_budget_s: float = 600.0,
    ) -> None:
        """Connection errors, timeouts and HTTP 5xx are retried ``retries`` times, waiting ``backoff`` s, then
        twice as long each time up to 15 s (about a minute with the defaults); a server still down after that
        is waited for, every 15 s with a warning each time, until ``retry_budget_s`` seconds have passed since
        the search first failed (a server a scheduler restarts is picked up); past that the run stops with one
        message naming the URL. `check` (before a run's first step) does not wait: a wrong URL fails at once."""
        self.url = url if url.rstrip("/").endswith("/retrieve") else url.rstrip("/") + "/retrieve"
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.retry_budget_s = max(0.0, float(retry_budget_s))

    def check(self) -> None:
        """One search, retried as `search`'s first attempt is but never waited for past it: a service a job
        starts beside training (or a wrong URL) is known before the first step, not minutes into it."""
        self._post(["health check"], 1, budget=0.0)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        if not queries:
            return []
        return self._post(queries, k, self.retry_budget_s)

    def _post(self, queries: list[str], k: int, budget: float) -> list[list[Doc]]:
        deadline: float | None = None
        while True:
            try:
                payload = post_json(
                    self.url,
                    {"queries": queries, "topk": k, "return_scores": True},
                    self.timeout,
                    self.retries,
                    self.backoff,
                )
                break
            except ServiceError as exc:
                now = time.monotonic()
                deadline = now + budget if deadline is None else deadline
                if (exc.status is not None and exc.status < 500) or now >= deadline:
                    hint = (
                        ""
                        if exc.status
                        else " Is it running? Start one with `searchrl serve-retriever --retriever bm25 --corpus "
                        "CORPUS`."
                    )
                    waited = (
                        f" (waited {budget:g} s for it: env.retriever.args.retry_budget_s)" if budget else ""
                    )
                    raise RetrieverUnavailable(f"retrieval server: {exc}{waited}.{hint}") from None
                wait = min(15.0, deadline - now)
                log.warning(
                    "retrieval server %s is not answering (%s); waiting for it, %.0f s of retry_budget_s %g left",
                    self.url,
                    exc,
                    deadline - now,
                    budget,
                )
                time.sleep(wait)
        try:
            rows = payload["result"]
            if not isinstance(rows, list) or len(rows) != len(queries):
                raise ValueError(
                    f"{len(rows) if isinstance(rows, list) else type(rows).__name__} result rows"
                )
            return [[_parse_doc(item) for item in row] for row in rows]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RetrieverUnavailable(
                f"retrieval server {self.url} answered in an unexpected shape ({type(exc).__name__}: {exc}); "
                'expected {"result": [[{"document": {"id", "contents"}, "score"}, ...] per query]}: '
                f"{str(payload)[:200]}"
            ) from None


def _parse_doc(item: dict[str, Any]) -> Doc:
    doc, score = (item["document"], float(item.get("score", 0.0))) if "document" in item else (item, 0.0)
    if "contents" in doc:
        return Doc.from_contents(str(doc.get("id", "")), doc["contents"], score)
    return Doc(id=str(doc.get("id", "")), title=doc.get("title", ""), text=doc.get("text", ""), score=score)


LIMITS = {
    "max_queries": 1024,
    "max_topk": 100,
    "max_query_chars": 4096,
    "max_body_bytes": 8 * 2**20,
    "timeout": 60.0,
}


def make_app(
    retriever: Retriever,
    max_queries: int = 1024,
    max_topk: int = 100,
    max_query_chars: int = 4096,
    max_body_bytes: int = 8 * 2**20,
    timeout: float = 60.0,
) -> Any:
    """Search-R1's ``POST /retrieve`` (and ``GET /health``) for ``retriever``, as an ASGI app. Requests
    arriving together are answered by one retriever call (the largest ``topk`` among them, each cut to its
    own); every bad request gets a JSON error naming the limit."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from searchrl.core.asgi import BadRequest, Batcher, integer, json_app, read_json, with_timeout

    def search(_: Any, items: list[tuple[list[str], int]]) -> list[list[list[Doc]]]:
        flat = [q for queries, _ in items for q in queries]
        rows = retriever.search(flat, max(k for _, k in items)) if flat else []
        out, i = [], 0
        for queries, k in items:
            out.append([row[:k] for row in rows[i : i + len(queries)]])
            i += len(queries)
        return out

    batcher = Batcher(search)

    async def retrieve(request: Any) -> Any:
        req = await read_json(request)
        queries = req.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise BadRequest("'queries' must be a list of strings")
        if len(queries) > max_queries:
            raise BadRequest(f"{len(queries)} queries in one request; the server takes at most {max_queries}")
        if any(len(q) > max_query_chars for q in queries):
            raise BadRequest(f"a query longer than {max_query_chars} characters")
        topk = integer(req.get("topk", 3), "topk", 1, max_topk)
        results = await with_timeout(batcher.submit(None, (queries, topk)), timeout)
        body: list[list[dict[str, Any]]]
        if req.get("return_scores", False):
            body = [[{"document": d.to_json(), "score": d.score} for d in row] for row in results]
        else:
            body = [[d.to_json() for d in row] for row in results]
        return JSONResponse({"result": body})

    async def health(request: Any) -> Any:
        return JSONResponse(
            {"status": "ok", "retriever": type(retriever).__name__, "batched_calls": batcher.calls}
        )

    return json_app(
        [
            Route("/retrieve", retrieve, methods=["POST"]),
            Route("/retrieve/", retrieve, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        max_body_bytes,
    )


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, **limits: Any) -> Any:
    """A retrieval server (`searchrl.core.asgi.Served`, not started) for ``retriever``; port 0 picks a free
    port. ``limits``: `make_app`'s."""
    from searchrl.core.asgi import Served

    return Served(make_app(retriever, **limits), host, port)
