"""`searchrl serve-model`: an OpenAI-compatible ``/v1/chat/completions`` server for a local model, so any
client of that protocol (our LLM judge and summarizer included) can use it.

A convenience for local CPU models and small tests: requests arriving together with the same
``max_tokens`` and ``temperature`` are generated as one batch, ``max_tokens`` is capped (``max_tokens``
of the server, and the model's context), and a request that waits longer than ``timeout`` gets a 504.
For judges on GPUs, `vllm serve MODEL` speaks the same protocol with continuous batching.
"""

from __future__ import annotations

import time
from typing import Any

from searchrl.rollout.chat import LocalChat

ROLES = ("system", "user", "assistant", "tool", "developer")


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def make_chat_app(
    chat: LocalChat,
    name: str = "local",
    max_tokens: int = 1024,
    timeout: float = 300.0,
    max_body_bytes: int = 4 * 2**20,
) -> Any:
    """The ASGI app: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from searchrl.core.asgi import BadRequest, Batcher, integer, json_app, read_json, with_timeout

    cap = max(1, min(max_tokens, chat.max_context - 1))
    batcher = Batcher(lambda key, convs: chat.complete(convs, key[0], key[1]), max_items=16)

    async def completions(request: Any) -> Any:
        req = await read_json(request)
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise BadRequest(
                    f"messages[{i}] must be {{role: one of {', '.join(ROLES)}, content: string}}"
                )
        if req.get("stream"):  # answered whole or refused, never a stream the client cannot read
            raise BadRequest("'stream': true is not supported by serve-model; send stream: false")
        wanted = req.get("max_tokens", req.get("max_completion_tokens"))
        n_tokens = cap if wanted is None else min(integer(wanted, "max_tokens", 1, 10**9), cap)
        temperature = req.get("temperature", 0.0)
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= 2
        ):
            raise BadRequest(f"'temperature' must be a number from 0 to 2, got {temperature!r}")
        text, finish, n_prompt, n_completion = await with_timeout(
            batcher.submit((n_tokens, float(temperature)), messages), timeout
        )
        return JSONResponse(
            {
                "id": f"chatcmpl-{time.time_ns()}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.get("model", name),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                ],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_completion,
                    "total_tokens": n_prompt + n_completion,
                },
            }
        )

    async def models(request: Any) -> Any:
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "searchrl"}]}
        )

    async def health(request: Any) -> Any:
        return JSONResponse(
            {"status": "ok", "model": name, "max_tokens": cap, "batched_calls": batcher.calls}
        )

    routes = [Route(p, completions, methods=["POST"]) for p in ("/v1/chat/completions", "/chat/completions")]
    routes += [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])]
    return json_app(routes, max_body_bytes, _error)


def make_chat_server(
    chat: LocalChat, name: str = "local", host: str = "127.0.0.1", port: int = 8001, **limits: Any
) -> Any:
    """An OpenAI-compatible chat server (`searchrl.core.asgi.Served`, not started); port 0 picks a free port."""
    from searchrl.core.asgi import Served

    return Served(make_chat_app(chat, name, **limits), host, port)
