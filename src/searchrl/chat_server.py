"""`searchrl serve-model`: an OpenAI-compatible ``/v1/chat/completions`` server for a local model, so any
client of that protocol (our LLM judge and summarizer included) can use it, on a CPU or a GPU. For GPU
judges, `vllm serve` is the faster server of the same protocol.
"""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

from searchrl.rollout.chat import LocalChat
from searchrl.serving import JSONHandler


class _ChatHandler(JSONHandler):
    chat: LocalChat
    name: str
    lock: threading.Lock

    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self.reply(
                404, {"error": {"message": f"unknown path {self.path}; use POST /v1/chat/completions"}}
            )
            return
        try:
            req = self.read_json()
            messages = req["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "content" in m for m in messages
            ):
                raise ValueError("'messages' must be a list of {role, content} objects")
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 256)
            temperature = float(req.get("temperature", 0.0))
        except (ValueError, KeyError, TypeError) as exc:
            self.reply(400, {"error": {"message": f"bad request: {exc}"}})
            return
        with self.lock:  # one generation at a time on this model
            [(text, finish)] = self.chat.complete([messages], max_tokens, temperature)
        self.reply(200, {
            "id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": req.get("model", self.name),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        })  # fmt: skip


def make_chat_server(chat: LocalChat, name: str = "local", host: str = "127.0.0.1", port: int = 8001
                     ) -> ThreadingHTTPServer:  # fmt: skip
    """An OpenAI-compatible chat server for a local model (not started). Port 0 picks a free port."""
    handler = type("Handler", (_ChatHandler,), {"chat": chat, "name": name, "lock": threading.Lock()})
    return ThreadingHTTPServer((host, port), handler)
