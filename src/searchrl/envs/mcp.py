"""MCP tools: an agent calls the tools of a Model Context Protocol server (the official ``mcp`` SDK, imported
lazily; ``pip install "searchrl[mcp]"``), and our retriever served as one (``searchrl serve-retriever --mcp``).

`MCPConnection` keeps one client session to a server for the whole run, on an event loop in its own thread,
so the environment's synchronous steps can call it: a batch of calls is sent concurrently and waited for.
The server is a URL (streamable HTTP) or a command line (a subprocess spoken to over stdio). Connecting has
its own bound (``connect_timeout``: a server that takes a minute to load its index can still have short
calls); a session that ended (the server died, the network dropped) is opened again at the next batch of
calls, at most once every ``retry_every`` seconds, and until then its calls read why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from searchrl.core.errors import DataError, SearchRLError
from searchrl.core.records import Doc
from searchrl.core.types import EnvState
from searchrl.envs.tools import Tool, ToolResult, format_tool_docs

log = logging.getLogger(__name__)


def _sdk() -> Any:
    try:
        import mcp
    except ImportError as exc:
        raise SearchRLError("MCP tools need the mcp SDK: pip install 'searchrl[mcp]'") from exc
    return mcp


class MCPConnection:
    """One session with an MCP server: its tools listed at connect, calls run on the session's loop."""

    def __init__(
        self,
        server: str | Sequence[str],
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        headers: dict[str, str] | None = None,
        inherit_env: bool = True,
        connect_timeout: float = 120.0,
        retry_every: float = 5.0,
    ) -> None:
        """``server``: a URL (streamable HTTP; ``headers`` sent with every request) or a command line (stdio;
        run in ``cwd`` with the trainer's environment variables, ``HF_HUB_OFFLINE``, API keys and
        ``CUDA_VISIBLE_DEVICES`` among them, plus ``env``; ``inherit_env: false`` gives it ``env`` alone).
        ``timeout`` bounds each call, ``connect_timeout`` starting the server and listing its tools."""
        mcp = self._mcp = _sdk()
        self.headers = dict(headers or {})
        if isinstance(server, str) and server.startswith(("http://", "https://")):
            self.target: Any = server
        else:
            argv = [server] if isinstance(server, str) else list(server)
            if not argv:
                raise DataError("an MCP server is a URL or a command line, got an empty command")
            variables = {**(os.environ if inherit_env else {}), **{k: str(v) for k, v in (env or {}).items()}}
            self.target = mcp.StdioServerParameters(command=argv[0], args=argv[1:], env=variables, cwd=cwd)
        self.name, self.timeout = server if isinstance(server, str) else " ".join(server), timeout
        self.connect_timeout, self.retry_every = connect_timeout, retry_every
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="searchrl-mcp", daemon=True)
        self._thread.start()
        self._queue: asyncio.Queue[Any] | None = None
        self._closed, self._last_try, self.reconnects = False, 0.0, 0
        try:
            self.tools = self._connect()
        except Exception as exc:
            self.close()
            raise SearchRLError(
                f"MCP server {self.name}: could not connect and list its tools within "
                f"{connect_timeout:g} s (connect_timeout): {exc or type(exc).__name__}"
            ) from exc

    def _connect(self) -> list[Any]:
        """Open a session (in `_serve`) and wait for its tool list."""
        self._last_try = time.monotonic()
        self._queue = None
        self._ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(self._mcp), self._loop)
        try:
            return self._ready.result(self.connect_timeout)
        except BaseException:
            self._main.cancel()
            raise

    async def _serve(self, mcp: Any) -> None:
        """Enter the session, list the tools, then run batches of calls until `close` (in one task, as the
        SDK's context managers require)."""
        self._queue = asyncio.Queue()
        target = self.target
        if isinstance(target, str) and self.headers:
            from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

            target = streamable_http_client(target, http_client=create_mcp_http_client(headers=self.headers))
        try:
            read = max(self.timeout, self.connect_timeout)  # each call is bounded by `timeout` below
            async with mcp.Client(target, read_timeout_seconds=read) as client:
                self._ready.set_result(list((await client.list_tools()).tools))
                while (item := await self._queue.get()) is not None:
                    calls, done = item
                    got = await asyncio.gather(
                        *(asyncio.wait_for(client.call_tool(n, a), self.timeout) for n, a in calls),
                        return_exceptions=True,
                    )
                    if not done.done():
                        done.set_result(got)
                    if any(_closed(r) for r in got):  # the server died: end this session, the next opens one
                        raise ConnectionError(f"MCP server {self.name} closed the connection")
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def call(self, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        """The results (``CallToolResult`` or an exception) of these calls, run concurrently. Never raises for
        a call: a call slower than ``timeout`` (each waits at most that long), arguments that are not JSON
        text, a server that stopped answering or a session that ended give that call an exception, which the
        model reads as an error (`_result`); one bad call does not affect the others or later ones."""
        out: list[Any] = [None] * len(calls)
        send = []
        for i, (_, args) in enumerate(calls):
            try:
                json.dumps(args, ensure_ascii=False, allow_nan=False).encode("utf-8")
                send.append(i)
            except (TypeError, ValueError, RecursionError) as exc:  # never put on the wire: it would break it
                out[i] = ValueError(f"the arguments are not JSON text: {exc}")
        if send:
            for i, r in zip(send, self._send([calls[i] for i in send])):
                out[i] = r
        return out

    def _alive(self) -> bool:
        return self._queue is not None and not self._main.done()

    def _send(self, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        if not self._alive() and not self._closed and time.monotonic() - self._last_try >= self.retry_every:
            ended = self._main.exception() if self._main.done() and not self._main.cancelled() else None
            try:  # the server died or the connection dropped: a new session
                self._connect()
                self.reconnects += 1
                log.warning("MCP server %s: the session had ended (%s); reconnected", self.name, ended)
            except Exception as exc:
                log.warning("MCP server %s: the session had ended; reconnecting failed: %s", self.name, exc)
        queue = self._queue
        if queue is None or self._main.done():
            why = self._main.exception() if self._main.done() and not self._main.cancelled() else None
            state = (
                "is closed"
                if self._closed
                else f"has ended ({why}); it is reconnected at most every {self.retry_every:g} s"
            )
            return [ConnectionError(f"the session with MCP server {self.name} {state}")] * len(calls)
        done: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(queue.put_nowait, (calls, done))
        try:  # each call is bounded by the timeout inside the session; this bounds a stuck session
            return done.result(self.timeout + 30)
        except concurrent.futures.TimeoutError:
            return [
                TimeoutError(f"MCP server {self.name} did not answer within {self.timeout + 30:.0f} s")
            ] * len(calls)

    def close(self) -> None:
        self._closed = True
        if self._queue is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
            with contextlib.suppress(
                Exception
            ):  # a session that ended badly: the loop stops below either way
                self._main.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def as_tools(self, include: Sequence[str] | None = None) -> list[Tool]:
        """The server's tools (those named in ``include``, if given) as our `Tool`s."""
        names = [t.name for t in self.tools]
        missing = [n for n in include or () if n not in names]
        if missing:
            raise DataError(f"MCP server {self.name} has no tool {missing[0]!r}; it has {', '.join(names)}")
        return [self._tool(t) for t in self.tools if include is None or t.name in include]

    def _tool(self, spec: Any) -> Tool:
        def run(calls: list[tuple[dict[str, Any], EnvState]]) -> list[ToolResult]:
            return [_result(r) for r in self.call([(spec.name, args) for args, _ in calls])]

        schema = _field(spec, "input_schema", "inputSchema") or {"type": "object", "properties": {}}
        return Tool(spec.name, spec.description or "", dict(schema), run)


def _closed(result: Any) -> bool:
    """Whether a call failed because the connection closed (the SDK's ``CONNECTION_CLOSED`` error)."""
    code = getattr(getattr(result, "error", None), "code", None)
    return isinstance(result, BaseException) and code == getattr(_sdk().types, "CONNECTION_CLOSED", -32000)


def _field(obj: Any, name: str, v1_name: str) -> Any:
    """A field by its mcp 2 name, or its mcp 1 (camel-case) one."""
    value = getattr(obj, name, None)
    return value if value is not None else getattr(obj, v1_name, None)


_DOC_LINE = re.compile(r"^Doc \d+ \[(?P<id>[^\]\n]*)\]\(Title: (?P<title>[^)\n]*)\) ?(?P<text>.*)$", re.M)


def _result(r: Any) -> ToolResult:
    """An MCP call's result as the text the model reads (its text blocks joined); errors say so. Documents
    written as the tool protocol shows them (``Doc i [id](Title: t) text``: `serve-retriever --mcp`'s
    format) are recorded as the call's documents, so ``open``, gold-document recall and StepSearch's rewards
    see what an MCP search retrieved. A result of images alone says that it cannot be shown."""
    if isinstance(r, BaseException):
        why = str(r) or type(r).__name__  # asyncio's TimeoutError has no message
        return ToolResult(f"Error: the tool call failed: {why}", error="tool_error")
    blocks = list(r.content or [])
    text = "\n".join(getattr(b, "text", "") for b in blocks if getattr(b, "type", "") == "text")
    if _field(r, "is_error", "isError"):
        return ToolResult(f"Error: {text}", error="tool_error")
    if not text and blocks:
        kinds = sorted({str(getattr(b, "type", "?")) for b in blocks})
        return ToolResult(
            f"Error: the tool returned {len(blocks)} block(s) of {', '.join(kinds)} and no text; this "
            "environment shows text only.",
            error="non_text_result",
        )
    docs = tuple(Doc(m["id"], m["title"], m["text"]) for m in _DOC_LINE.finditer(text))
    return ToolResult(text, docs)


def serve_retriever_mcp(
    retriever: Any,
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    topk: int = 3,
    max_topk: int = 20,
    timeout: float = 60.0,
    max_query_chars: int = 4096,
) -> None:
    """Serve ``retriever`` as an MCP server with one tool, ``search(query, k)`` (documents as the tool
    protocol shows them: ``Doc i [id](Title: t) text``). ``k`` is bounded by ``max_topk``, a query by
    ``max_query_chars``, a search by ``timeout`` seconds (an error the client reads). Blocks until the
    transport closes."""
    from importlib.metadata import PackageNotFoundError, version
    from typing import Annotated

    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.server.mcpserver.tools import Tool as ServerTool
    from pydantic import ConfigDict, Field

    try:
        ours = version("searchrl")
    except PackageNotFoundError:  # run from a source tree that was not installed
        ours = "0+unknown"
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="searchrl-mcp-search")

    def search(query, k=topk):  # type: ignore[no-untyped-def]
        """Search the document collection: the top documents for the query, each with its id and title."""
        # ToolError: the client reads the reason (any other exception reaches it as a bare "Error executing")
        if len(query) > max_query_chars:
            raise ToolError(f"the query has {len(query)} characters; at most {max_query_chars}")
        if not query.strip():
            raise ToolError("the query is empty")
        job = pool.submit(retriever.search, [" ".join(query.split())], k)
        try:
            [docs] = job.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ToolError(f"the search took longer than {timeout:g} s") from None
        return format_tool_docs(docs)

    # real objects, not this module's postponed (string) annotations, which the SDK evaluates in its own scope
    search.__annotations__ = {
        "query": Annotated[str, Field(description="what to search for")],
        "k": Annotated[
            int, Field(ge=1, le=max_topk, description=f"how many documents to return (1 to {max_topk})")
        ],
        "return": str,
    }
    tool = ServerTool.from_function(search)
    base = tool.fn_metadata.arg_model  # arguments it does not take are refused, not ignored

    class StrictArguments(base):  # type: ignore[valid-type,misc]
        model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    tool.fn_metadata.arg_model = StrictArguments
    server = MCPServer(
        "searchrl-retriever", instructions="Search a document collection.", version=ours, tools=[tool]
    )
    if transport == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host=host, port=port)
