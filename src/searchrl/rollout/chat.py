"""Chat models for judges and summarizers: a local Hugging Face model through `HFGenerator` (`LocalChat`), or
any OpenAI-compatible server (`OpenAIChatClient`), behind one batched client (`chat_client`); and RAG-Gym's
LLM summarizer built on them (`searchrl serve-model` serves a `LocalChat`, see `searchrl.app.chat_server`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.serving import FailureCounter, ServiceError, post_json, redact
from searchrl.envs.summarize import NO_ANSWER, SUMMARY_PROMPT, SummaryItem

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
        self.generator = HFGenerator(
            model.eval(), tokenizer, stop_strings=(), batch_size=batch_size, reuse_cache=False
        )

    @classmethod
    def load(cls, path: str, **kwargs: Any) -> LocalChat:
        from searchrl.models.load import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(path)
        return cls(model, tok, **kwargs)

    def complete(
        self, conversations: list[Messages], max_tokens: int = 256, temperature: float = 0.0
    ) -> list[tuple[str, str, int, int]]:
        """(text, finish reason "stop" | "length", prompt tokens, completion tokens) per conversation;
        over-long prompts keep their end."""
        from searchrl.rollout.generator import SamplingParams

        keep = max(1, self.max_context - max_tokens)
        prompts = [chat_prompt(self.tokenizer, m)[-keep:] for m in conversations]
        gens = self.generator.generate(prompts, SamplingParams(temperature, 1.0, max_tokens))
        return [
            (
                self.tokenizer.decode(g.token_ids, skip_special_tokens=True),
                "length" if g.finish == "length" else "stop",
                len(p),
                len(g.token_ids),
            )
            for p, g in zip(prompts, gens)
        ]


class OpenAIChatClient:
    """Concurrent requests to an OpenAI-compatible endpoint. A request that fails after its retries answers
    None and is counted (``counter``: the run stops when they exceed ``max_failure_rate``)."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key_env: str | None,
        timeout: float,
        retries: int,
        workers: int,
        name: str = "chat",
        max_failure_rate: float = 0.05,
    ) -> None:
        self.url = url.rstrip("/") + (
            "" if url.rstrip("/").endswith("/chat/completions") else "/chat/completions"
        )
        self.model, self.api_key_env = model, api_key_env
        self.timeout, self.retries, self.workers = timeout, retries, workers
        self.counter = FailureCounter(name, self.url, max_failure_rate)

    def _one(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> str | None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        try:
            out = post_json(self.url, body, self.timeout, self.retries, 0.5, headers)
        except ServiceError as exc:
            self.counter.record(str(exc))
            return None
        try:
            text = str(out["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            shown = redact(str(out)[:200], [key] if key else [])
            self.counter.record(f"{self.url} answered without choices[0].message.content: {shown}")
            return None
        self.counter.record()
        return text

    def complete(
        self, conversations: list[list[dict[str, str]]], max_tokens: int, temperature: float
    ) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            return list(pool.map(lambda m: self._one(m, max_tokens, temperature), conversations))


def chat_client(
    backend: str,
    model: str,
    url: str,
    api_key_env: str | None,
    timeout: float,
    retries: int,
    workers: int,
    key: str,
    max_failure_rate: float = 0.05,
    service: str = "chat",
) -> Any:
    """A batched chat client: an OpenAI-compatible server (``openai``) or a local model directory (``hf``).
    ``key`` names the config section in errors, ``service`` the client in metrics (``service/<name>/…``)."""
    if backend not in ("hf", "openai"):
        raise DataError(f"{key}.backend must be 'hf' or 'openai', got {backend!r}")
    if not model:
        raise DataError(f"{key}.model is required: a local model directory (hf) or a model name (openai)")
    if backend == "openai":
        return OpenAIChatClient(url, model, api_key_env, timeout, retries, workers, service, max_failure_rate)
    return _LocalClient(LocalChat.load(model), FailureCounter(service, model, max_failure_rate))


def client_from_args(args: dict[str, Any], key: str, service: str) -> Any:
    """`chat_client` from a config mapping (``backend``, ``model``, ``url``, ``api_key_env``, ``timeout``,
    ``retries``, ``workers``, ``max_failure_rate``); unknown keys are refused, naming ``key``."""
    defaults: dict[str, Any] = {
        "backend": "openai",
        "model": "",
        "url": "http://127.0.0.1:8001/v1",
        "api_key_env": "OPENAI_API_KEY",
        "timeout": 60.0,
        "retries": 2,
        "workers": 8,
        "max_failure_rate": 0.05,
    }
    unknown = sorted(set(args) - set(defaults))
    if unknown:
        raise DataError(f"{key}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(defaults)}")
    a = {**defaults, **args}
    return chat_client(
        a["backend"],
        a["model"],
        a["url"],
        a["api_key_env"],
        float(a["timeout"]),
        int(a["retries"]),
        int(a["workers"]),
        key,
        float(a["max_failure_rate"]),
        service,
    )


class _LocalClient:
    """A local model behind the client interface; its requests are counted like an endpoint's (a reply its
    caller cannot use is rejected there)."""

    def __init__(self, chat: Any, counter: FailureCounter) -> None:
        self.chat, self.counter = chat, counter

    def complete(
        self, conversations: list[list[dict[str, str]]], max_tokens: int, temperature: float
    ) -> list[str | None]:
        out = [reply[0] for reply in self.chat.complete(conversations, max_tokens, temperature)]
        for _ in out:
            self.counter.record()
        return out


class LLMSummarizer:
    """Figure 7's prompt to a chat model; a failed request falls back to `NO_ANSWER` and is counted
    (``service/summarizer/failures``; above ``max_failure_rate`` of the requests the run stops)."""

    def __init__(
        self,
        backend: str = "openai",
        model: str = "",
        url: str = "http://127.0.0.1:8001/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        max_tokens: int = 128,
        temperature: float = 0.0,
        timeout: float = 60.0,
        retries: int = 2,
        workers: int = 8,
        max_doc_chars: int = 4000,
        max_failure_rate: float = 0.05,
    ) -> None:
        self.client = client_from_args(
            {
                "backend": backend,
                "model": model,
                "url": url,
                "api_key_env": api_key_env,
                "timeout": timeout,
                "retries": retries,
                "workers": workers,
                "max_failure_rate": max_failure_rate,
            },
            "env.summarizer",
            "summarizer",
        )
        self.max_tokens, self.temperature, self.max_doc_chars = max_tokens, temperature, max_doc_chars

    def __call__(self, items: Sequence[SummaryItem]) -> list[str]:
        convs = []
        from searchrl.data.corpus import format_docs

        for question, query, docs in items:
            text = format_docs(docs)
            prompt = SUMMARY_PROMPT.format(
                documents=text[: self.max_doc_chars], question=question, query=query
            )
            convs.append([{"role": "user", "content": prompt}])
        out = self.client.complete(convs, self.max_tokens, self.temperature) if convs else []
        return [" ".join(t.split()) if t and t.strip() else NO_ANSWER for t in out]
