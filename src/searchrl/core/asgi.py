"""The servers' common ASGI pieces (Starlette on uvicorn): JSON errors for every bad request, a request
body limit, per-request timeouts, a micro-batcher that turns concurrent requests into one model or
retriever call, and a runner that binds the socket itself (a clear error for a port in use, a deep listen
backlog) and can run in a background thread (tests, benchmarks).

Used by `searchrl serve-retriever` (`envs.retrievers.http`) and `searchrl serve-model` (`chat_server`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from searchrl.core.errors import SearchRLError


class BadRequest(Exception):
    """A request the server refuses with HTTP 400 and this message."""


def json_app(
    routes: Sequence[Any], max_body_bytes: int, error_body: Callable[[str], Any] = lambda m: {"error": m}
) -> Any:
    """A Starlette app whose every error is JSON (``error_body(message)``): 400 for `BadRequest`, the
    framework's status for HTTP errors (404, 405, 413 over ``max_body_bytes``), 500 otherwise."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    async def http_error(request: Any, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        detail = exc.detail if exc.status_code != 413 else f"request body above {max_body_bytes} bytes"
        return JSONResponse(error_body(str(detail)), status_code=exc.status_code, headers=exc.headers)

    async def bad_request(request: Any, exc: Exception) -> Any:
        return JSONResponse(error_body(f"bad request: {exc}"), status_code=400)

    async def server_error(request: Any, exc: Exception) -> Any:
        return JSONResponse(error_body(f"server error: {type(exc).__name__}: {exc}"), status_code=500)

    app = Starlette(
        routes=list(routes),
        exception_handlers={HTTPException: http_error, BadRequest: bad_request, Exception: server_error},
    )
    app.state.max_body_bytes = max_body_bytes
    return app


async def read_json(request: Any) -> dict[str, Any]:
    """The request's JSON object, or `BadRequest` (not JSON, too deeply nested, not an object); a body
    above the app's ``max_body_bytes`` is refused (413) before it is read, or as soon as it passes it."""
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    limit = request.app.state.max_body_bytes
    bound = float(getattr(request.app.state, "body_timeout", 30.0))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413)
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413)
            chunks.append(chunk)

    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    try:  # a client that announces a body and never sends it holds no connection past the bound
        await asyncio.wait_for(read(), bound)
    except asyncio.TimeoutError:
        logging.getLogger("uvicorn.error").warning(
            "%s sent %d bytes of its %s %s body in %g s; request dropped",
            client,
            size,
            request.method,
            request.url.path,
            bound,
        )
        raise HTTPException(
            408, f"the request body did not arrive within {bound:g} s", headers={"Connection": "close"}
        ) from None
    except ClientDisconnect:  # the client went away mid-body: one line in the log, not a traceback
        logging.getLogger("uvicorn.error").warning(
            "%s disconnected after %d bytes of its %s %s body; request dropped",
            client,
            size,
            request.method,
            request.url.path,
        )
        raise HTTPException(400, "the client disconnected before sending the whole body") from None
    body = b"".join(chunks)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data


def integer(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high] (JSON numbers only: no booleans, fractions or infinities)."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok or (isinstance(value, float) and value.is_integer())
    if not ok or not low <= int(value) <= high:
        raise BadRequest(f"'{name}' must be an integer from {low} to {high}, got {value!r}")
    return int(value)


async def with_timeout(work: Awaitable[Any], seconds: float) -> Any:
    from starlette.exceptions import HTTPException

    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise HTTPException(
            504, f"the request took longer than the server's timeout ({seconds:g} s)"
        ) from None


class Batcher:
    """Concurrent requests into one call: ``submit(key, item)`` queues an item; a worker takes every queued
    item with the first one's ``key`` (up to ``max_items``), runs ``fn(key, items)`` in a thread (one call
    at a time: models and retrievers are not assumed thread-safe) and answers each request with its result.
    """

    def __init__(self, fn: Callable[[Any, list[Any]], list[Any]], max_items: int = 256) -> None:
        self.fn, self.max_items = fn, max_items
        self._queue: list[tuple[Any, Any, asyncio.Future[Any]]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self.calls = 0

    async def submit(self, key: Any, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run())
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((key, item, fut))
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                key = self._queue[0][0]
                batch = [q for q in self._queue if q[0] == key][: self.max_items]
                taken = {id(q) for q in batch}
                self._queue = [q for q in self._queue if id(q) not in taken]
                live = [q for q in batch if not q[2].done()]  # timed-out requests are dropped
                if not live:
                    continue
                self.calls += 1
                try:
                    results = await asyncio.to_thread(self.fn, key, [q[1] for q in live])
                except Exception as exc:  # every request of the batch answers the error
                    for q in live:
                        if not q[2].done():
                            q[2].set_exception(exc)
                    continue
                for q, r in zip(live, results):
                    if not q[2].done():
                        q[2].set_result(r)


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or `SearchRLError` naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SearchRLError(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def head_deadline_protocol(timeout: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within ``timeout``
    seconds of opening, or of its last response. uvicorn's keep-alive timer starts only after a response and
    stops at the first byte of the next request, so a connection that never completes a head (slowloris, a
    half-open socket) stayed open for good: 500 of them held the servers' connection slots for a whole probe."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):  # type: ignore[misc]
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


class Served:
    """An app on a bound socket: ``run()`` blocks (the CLI); ``start()`` serves from a thread and
    ``stop()`` ends it (tests, benchmarks). ``url`` is the address it serves. A connection that sends no
    whole request head within ``head_timeout`` seconds is closed (`head_deadline_protocol`), a request whose
    body does not arrive within ``body_timeout`` seconds answered 408 (`read_json`); an idle keep-alive
    connection is closed after ``timeout_keep_alive``."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_keep_alive: int = 30,
        head_timeout: float = 30.0,
        body_timeout: float = 30.0,
    ) -> None:
        import uvicorn

        app.state.body_timeout = body_timeout

        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=timeout_keep_alive,
            lifespan="off",
            ws="none",
            http=head_deadline_protocol(head_timeout),
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self) -> Served:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        if not self.server.started:
            raise SearchRLError(f"the server on {self.url} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
