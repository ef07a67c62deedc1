"""History knowledge summarisation for RAG-Gym's ReSearch agent (§3, eq. 8; prompt: Figure 7).

The ReSearch agent does not keep the documents its searches returned: each (query, documents) pair of
its history becomes (query, m), m a short answer to the query drawn from those documents. A summariser
takes a batch of (question, query, documents) and returns one m each. Chosen by name in ``env.summarizer``
(the registry, `searchrl.rollout.summarizers`, sits where the chat models are):

- ``extract`` (default, no model): the ``max_sentences`` document sentences sharing the most (crudely
  stemmed) words with the query, in document order, or `NO_ANSWER` when no sentence shares a word with it.
  On the quickstart world the answer of a hop is in the 1 / 2 / 3 chosen sentences of its gold document
  61% / 70% / 87% of the time (relations are paraphrased: "city" vs "is located in"); default 2;
- ``llm``: an untuned chat model prompted with Figure 7 (RAG-Gym leaves the summariser untuned and trains
  only the action model), through an OpenAI-compatible server or a local model directory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from searchrl.core.answers import normalize_answer
from searchrl.core.errors import DataError
from searchrl.core.records import Doc

SummaryItem = tuple[str, str, Sequence[Doc]]  # (question, query, documents)

NO_ANSWER = "The documents do not answer this query."
_SENTENCE = re.compile(r"(?<=[.!?])\s+")

# RAG-Gym Figure 7, verbatim.
SUMMARY_PROMPT = """You are a helpful assistant tasked with answering a follow-up query using the relevant documents provided.

### Relevant Documents
{documents}

### Context
Original question: {question}

### Follow-up Query
{query}

Answer the follow-up query succinctly, using only the information from the documents. When the documents do not provide sufficient information, explicitly point this out instead of making up facts. Do not include unrelated or excessive details in the response."""


def _stems(text: str) -> set[str]:
    """Normalized words cut to 5 characters: a crude stemmer (founder/founded, director/directed)."""
    return {w[:5] for w in normalize_answer(text).split()}


class ExtractiveSummarizer:
    """The ``max_sentences`` document sentences with the largest word overlap with the query."""

    def __init__(self, max_sentences: int = 2) -> None:
        if max_sentences < 1:
            raise DataError(f"env.summarizer.args.max_sentences must be at least 1, got {max_sentences}")
        self.max_sentences = max_sentences

    def __call__(self, items: Sequence[SummaryItem]) -> list[str]:
        return [self.one(query, docs) for _, query, docs in items]

    def one(self, query: str, docs: Sequence[Doc]) -> str:
        q = _stems(query)
        sentences = [s for d in docs for s in _SENTENCE.split(d.text.strip()) if s]
        scored = [(len(q & _stems(s)), -i, s) for i, s in enumerate(sentences)]
        best = sorted((x for x in scored if x[0] > 0), reverse=True)[: self.max_sentences]
        return " ".join(s for *_, s in sorted(best, key=lambda x: -x[1])) if best else NO_ANSWER
