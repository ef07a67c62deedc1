"""A simulated search engine (ZeroSearch, arXiv 2505.04588): the documents for a query are written by a
model (``source: llm``) or drawn from the corpus (``source: corpus``), useful or deliberately noisy, with the
paper's curriculum on the noise probability, as its released code computes it (``dynamic_threshold``)

    p_i = p_s + (b^(i/m) − 1) / (b − 1) · (p_e − p_s)     (i the training step counted from 1, as verl counts
                                                         it; m the total steps; b = 4 in the paper)

so that training starts on useful documents (p_s) and its last step reaches p_e noise. Every environment and algorithm uses
it like any retriever (``env.retriever: {name: simulated, args: {...}}``); the generated documents are
observations (masked from the loss) and recorded as the step's documents (recall, rewards and the viewer see
them).

Sources:

- ``llm``: a chat model (``llm: {backend, model, url, ...}``, the judge and summarizer client, built by the
  run and passed in as ``client``: this layer does not import the chat models) writes ``k``
  documents for the query from `USEFUL` or `NOISY`. ZeroSearch puts the question and its gold answer into
  the useful prompt (``with_answer``, default on) so that the simulator can write documents that hold the
  answer; the prompts are ours, following the paper's description (its own are for its fine-tuned simulator).
- ``corpus`` (runs on a CPU, tested end to end): useful documents are the base retriever's top ``k`` over the
  corpus (the synthetic world's own documents by default); noisy ones are ``k`` drawn at random from its
  ranks ``k+1 … (noise_depth+1)·k``: on topic, but not what the query needed.

Outside training steps (evaluation, `searchrl eval`, the trainer's held-out curve) nothing is noisy and no
answer is put in a prompt: the corpus source is then exactly its base retriever, the llm source the simulator
asked for useful documents from the query alone.

The noise draw of each query is seeded by (``seed``, step, the query's position in the step), so a run and
its resume draw the same. ``p_start``/``p_end`` defaults are assumptions (the paper's values were not in the
sources at hand); ``base`` is the paper's 4.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from searchrl.core.errors import DataError
from searchrl.core.records import Doc

USEFUL = """You are a search engine. Write {k} short documents (about {words} words each) that a web search for
the query below would return, holding facts that help answer it.{context}
Query: {query}
Write them as "Doc 1: <title> | <text>", one per line, and nothing else."""

NOISY = """You are a search engine. Write {k} short documents (about {words} words each) that a web search for
the query below might return, on its topic but without the facts it asks for (noisy results).
Query: {query}
Write them as "Doc 1: <title> | <text>", one per line, and nothing else."""

_DOC_LINE = re.compile(r"^\s*Doc\s*\d+\s*[:.)]\s*(.*)$", re.I)


def noise_probability(step: int, total: int, p_start: float, p_end: float, base: float) -> float:
    """ZeroSearch's curriculum as its code computes it: p_s + (b^(i/m) − 1)/(b − 1)·(p_e − p_s), with
    i = ``step`` + 1 (our steps count from 0, verl's global step from 1: the last step, i = m, is at p_e) and
    m = ``total`` (m ≥ 1); the limit b → 1, i/m, where b = 1."""
    m = max(1, total)
    frac = min(max(step + 1, 0), m) / m
    ramp = frac if abs(base - 1.0) < 1e-12 else (base**frac - 1.0) / (base - 1.0)
    return p_start + ramp * (p_end - p_start)


def parse_documents(text: str | None, query: str, k: int) -> list[Doc]:
    """At most ``k`` documents from a simulator's reply (``Doc n: title | text`` lines; a reply without such
    lines is one document); ids are content hashes, so equal documents are one document."""
    if not text or not text.strip():
        return []
    found = [m.group(1).strip() for line in text.splitlines() if (m := _DOC_LINE.match(line))]
    bodies = [b for b in found if b] or [" ".join(text.split())]
    out = []
    for body in bodies[:k]:
        title, sep, rest = body.partition("|")
        title, rest = (title.strip(), rest.strip()) if sep else (query, body)
        digest = hashlib.sha1(f"{title}\n{rest}".encode("utf-8", "replace")).hexdigest()[:12]
        out.append(Doc(id=f"sim-{digest}", title=title or query, text=rest))
    return out


class SimulatedRetriever:
    """See the module docstring. ``set_progress(step, total)`` (the trainer calls it before each step) moves
    the curriculum; ``set_progress(None)`` (after the step) ends it: no noise, no answers in prompts."""

    cacheable = False  # a query's documents depend on the step and the draw

    def __init__(
        self,
        docs: Sequence[Doc] | None = None,
        *,
        source: Literal["corpus", "llm"] = "corpus",
        retriever: dict[str, Any] | None = None,
        p_start: float = 0.0,
        p_end: float = 0.5,
        base: float = 4.0,
        seed: int = 0,
        noise_depth: int = 3,
        llm: dict[str, Any] | None = None,
        client: Any = None,
        words: int = 30,
        with_answer: bool = True,
        max_tokens: int = 512,
    ) -> None:
        for name, p in (("p_start", p_start), ("p_end", p_end)):
            if not 0.0 <= p <= 1.0:
                raise DataError(f"env.retriever.args.{name} must be in [0, 1], got {p}")
        if base <= 0:
            raise DataError(f"env.retriever.args.base must be positive, got {base}")
        if source not in ("corpus", "llm"):
            raise DataError(f"env.retriever.args.source must be 'corpus' or 'llm', got {source!r}")
        self.source, self.p_start, self.p_end, self.base, self.seed = source, p_start, p_end, base, seed
        self.noise_depth, self.words, self.with_answer, self.max_tokens = (
            noise_depth,
            words,
            with_answer,
            max_tokens,
        )
        self.step: int | None = None  # None: not in a training step
        self.total = 1
        self._drawn = 0  # queries drawn at this step
        self.noisy_served = self.served = 0
        self.base_retriever: Any = None
        self.client: Any = None
        if source == "corpus":
            if docs is None:
                raise DataError(
                    "the simulated retriever's corpus source needs a corpus (data.corpus or the world)"
                )
            from searchrl.envs.retrievers import build_retriever

            spec = dict(retriever or {"name": "bm25"})
            self.base_retriever = build_retriever(spec.pop("name", "bm25"), corpus=docs, **spec)
        else:
            if client is None:
                raise DataError(
                    "the simulated retriever's llm source needs a chat client: the trainer builds it from "
                    "env.retriever.args.llm ({backend, model, url, ...})"
                )
            self.client = client

    # ------------------------------------------------------------------ the curriculum
    def set_progress(self, step: int | None, total: int = 1) -> None:
        if (step, total) != (self.step, self.total):
            self.step, self.total, self._drawn = step, total, 0

    @property
    def noise(self) -> float:
        """This step's noise probability; 0 outside training steps."""
        if self.step is None:
            return 0.0
        return noise_probability(self.step, self.total, self.p_start, self.p_end, self.base)

    def _draws(self, n: int) -> list[bool]:
        """Whether each of the next ``n`` queries gets noisy documents."""
        p = self.noise
        out = []
        for _ in range(n):
            rng = random.Random(f"{self.seed}:{self.step}:{self._drawn}")
            self._drawn += 1
            out.append(rng.random() < p)
        self.served += n
        self.noisy_served += sum(out)
        return out

    # ------------------------------------------------------------------ search
    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        return self.search_with_context(queries, k, [None] * len(queries))

    def search_with_context(self, queries: list[str], k: int, examples: Sequence[Any]) -> list[list[Doc]]:
        """``examples``: the question each query was asked for (None when unknown): the useful prompt's
        context (``source: llm``)."""
        noisy = self._draws(len(queries))
        if self.source == "corpus":
            return self._from_corpus(queries, k, noisy)
        return self._from_llm(queries, k, noisy, examples)

    def _from_corpus(self, queries: list[str], k: int, noisy: list[bool]) -> list[list[Doc]]:
        depth = (self.noise_depth + 1) * k
        ranked = self.base_retriever.search(queries, depth if any(noisy) else k)
        out = []
        for i, (docs, bad) in enumerate(zip(ranked, noisy)):
            if not bad:
                out.append(list(docs[:k]))
                continue
            rest = list(docs[k:])
            rng = random.Random(f"{self.seed}:{self.step}:noise:{i}:{queries[i]}")
            out.append(rng.sample(rest, min(k, len(rest))))
        return out

    def _from_llm(
        self, queries: list[str], k: int, noisy: list[bool], examples: Sequence[Any]
    ) -> list[list[Doc]]:
        convs = []
        for q, bad, ex in zip(queries, noisy, examples):
            if bad:
                prompt = NOISY.format(k=k, words=self.words, query=q)
            else:
                context = ""
                if ex is not None and self.step is not None:  # training only: evaluation gets no hints
                    context = f"\nThe user is answering the question: {ex.question}"
                    if self.with_answer and ex.answers:
                        context += f"\nIts answer is: {' / '.join(ex.answers)}"
                prompt = USEFUL.format(k=k, words=self.words, query=q, context=context)
            convs.append([{"role": "user", "content": prompt}])
        replies = self.client.complete(convs, self.max_tokens, 0.0) if convs else []
        return [parse_documents(r, q, k) for r, q in zip(replies, queries)]
