"""Chat with a local Hugging Face model: prompt formatting, batched completion, and an OpenAI-compatible
``/v1/chat/completions`` server (``searchrl serve-model``) so any client of that protocol — our LLM judge
included — can use a local model, on a CPU or a GPU.
"""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from searchrl.serving import JSONHandler

Messages = list[dict[str, str]]


def chat_prompt(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of ``messages`` with the generation prompt: the tokenizer's chat template when it has
    one (Qwen2.5 does), else a plain ``Role: content`` transcript ending in ``Assistant:``."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class LocalChat:
    """Batched greedy (or sampled) chat completion with a local model through `HFGenerator`."""

    def __init__(self, model: Any, tokenizer: Any, max_context: int = 4096, batch_size: int = 16) -> None:
        from searchrl.rollout.hf import HFGenerator

        self.tokenizer, self.max_context = tokenizer, max_context
        self.generator = HFGenerator(model.eval(), tokenizer, stop_strings=(), batch_size=batch_size,
                                     reuse_cache=False)  # fmt: skip

    @classmethod
    def load(cls, path: str, **kwargs: Any) -> LocalChat:
        from searchrl.models.load import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(path)
        return cls(model, tok, **kwargs)

    def complete(self, conversations: list[Messages], max_tokens: int = 256, temperature: float = 0.0
                 ) -> list[tuple[str, str]]:  # fmt: skip
        """(text, finish reason "stop" | "length") per conversation; over-long prompts keep their end."""
        from searchrl.rollout.generator import SamplingParams

        keep = max(1, self.max_context - max_tokens)
        prompts = [chat_prompt(self.tokenizer, m)[-keep:] for m in conversations]
        gens = self.generator.generate(prompts, SamplingParams(temperature, 1.0, max_tokens))
        return [
            (
                self.tokenizer.decode(g.token_ids, skip_special_tokens=True),
                "length" if g.finish == "length" else "stop",
            )
            for g in gens
        ]


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
