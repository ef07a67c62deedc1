"""Searcher-only training against a frozen generator: s3's Gain Beyond RAG (Jiang et al. 2025, arXiv
2505.14146, §3.2):

    GBR(Q) = Acc(G(Q, D_selected), A) − Acc(G(Q, D_RAG), A)

The policy only has to search: a frozen generator G answers the question from the documents the policy's
searches selected, and the reward is how much better that answer is than G's answer from plain retrieval
D_RAG (the retriever's top ``rag_k`` for the question itself). Acc is s3's generation accuracy: cover EM,
else (with ``judge``) an LLM judge's verdict (`searchrl.rewards.answer_judge`). The policy's own answer
action is ignored: it ends the episode, nothing more.

- D_selected: the first ``keep`` documents of each of the episode's searches (s3 keeps 3 of the 8 it
  retrieves per turn), without repeats, at most ``max_docs``. s3's searcher marks the documents it keeps
  with ``<important_info>``; here the retriever's order stands in for that choice, so set ``env.topk`` to
  what a turn retrieves (s3: 8) and ``keep`` to what it keeps (3).
- G: ``generator: {backend, model, url, ...}``, a chat model asked for a short answer from the documents
  (`PROMPT`); or ``generator: null``, the *answer-in-documents* reader (Acc = 1 when a normalised gold answer
  occurs in the documents' text), a model-free stand-in that runs on a CPU and bounds what any reader could
  get from those documents (FlashRAG's answer recall).
- s3 drops from training the questions plain RAG already answers; `rag_answers` tells which they are
  (`searchrl` does not filter the data for you: write the filtered question file).

Metrics: ``reward/gbr/acc_selected``, ``…/acc_rag``, ``…/docs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from searchrl.core.answers import normalize_answer, sub_exact_match
from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.corpus import format_docs
from searchrl.rewards.contract import RewardOutput

PROMPT = """Answer the question using the documents. Reply with the answer only: a few words, no sentence.

Documents:
{documents}

Question: {question}
Answer:"""


def selected_documents(traj: Any, keep: int, max_docs: int) -> list[Doc]:
    """The first ``keep`` documents of each search of the episode, in order, without repeats."""
    state = traj.state
    out: list[Doc] = []
    seen: set[str] = set()
    for docs in state.retrieved if state is not None else []:
        for d in list(docs)[:keep]:
            if d.id not in seen and len(out) < max_docs:
                seen.add(d.id)
                out.append(d)
    return out


def answer_in_documents(docs: Sequence[Doc], answers: Sequence[str]) -> bool:
    """Whether a normalised gold answer occurs in the documents' normalised text."""
    text = f" {normalize_answer(' '.join(f'{d.title} {d.text}' for d in docs))} "
    return any(g and f" {g} " in text for g in (normalize_answer(a) for a in answers))


class GainBeyondRAG:
    """``gbr``: s3's reward (see the module docstring). Needs the run's retriever (a resource the trainer
    provides) for D_RAG."""

    def __init__(
        self,
        *,
        generator: dict[str, Any] | None = None,
        judge: dict[str, Any] | None = None,
        rag_k: int = 3,
        keep: int = 3,
        max_docs: int = 9,
        max_doc_chars: int = 600,
        max_tokens: int = 32,
    ) -> None:
        if min(rag_k, keep, max_docs) < 1:
            raise DataError(
                f"gbr: rag_k, keep and max_docs must be at least 1, got {rag_k}, {keep}, {max_docs}"
            )
        self.rag_k, self.keep, self.max_docs = rag_k, keep, max_docs
        self.max_doc_chars, self.max_tokens = max_doc_chars, max_tokens
        self.client: Any = None
        if generator is not None:
            from searchrl.rollout.chat import client_from_args

            self.client = client_from_args(dict(generator), "rewards.gbr.args.generator", "gbr_generator")
        self.judge: Any = None
        if judge is not None:
            from searchrl.rewards.answer_judge import AnswerJudge

            self.judge = AnswerJudge(**{"key": "rewards.gbr.args.judge", **judge})
        self.resources: Mapping[str, Callable[[], Any]] = {}

    # ------------------------------------------------------------------ pieces
    def _retriever(self) -> Any:
        if "retriever" not in self.resources:
            raise DataError("the gbr reward needs the run's retriever (train it with `searchrl train`)")
        return self.resources["retriever"]()

    def rag_documents(self, questions: list[str]) -> list[list[Doc]]:
        """D_RAG: the retriever's top ``rag_k`` for each question itself."""
        return [list(d) for d in self._retriever().search(questions, self.rag_k)] if questions else []

    def accuracy(self, items: list[tuple[str, Sequence[str], list[Doc]]]) -> list[float]:
        """Acc(G(Q, D), A) for each (question, gold answers, documents)."""
        if self.client is None:
            return [float(answer_in_documents(docs, golds)) for _, golds, docs in items]
        convs = []
        for question, _, docs in items:
            text = format_docs([Doc(d.id, d.title, d.text[: self.max_doc_chars]) for d in docs]) or "(none)"
            convs.append([{"role": "user", "content": PROMPT.format(documents=text, question=question)}])
        replies = self.client.complete(convs, self.max_tokens, 0.0)
        preds = [" ".join((r or "").split()) or None for r in replies]
        out = [
            float(p is not None and sub_exact_match(p, golds) > 0) for p, (_, golds, _) in zip(preds, items)
        ]
        if self.judge is not None:  # generation accuracy: cover EM, else the judge
            rest = [i for i, a in enumerate(out) if a == 0.0 and preds[i] is not None]
            verdicts = self.judge([(items[i][0], items[i][1], preds[i]) for i in rest]) if rest else []
            for i, v in zip(rest, verdicts):
                out[i] = float(bool(v))
        return out

    def rag_answers(self, examples: Sequence[Any]) -> list[bool]:
        """Whether plain RAG already answers each example (s3 drops those from training)."""
        docs = self.rag_documents([ex.question for ex in examples])
        acc = self.accuracy([(ex.question, ex.answers, d) for ex, d in zip(examples, docs)])
        return [a > 0 for a in acc]

    # ------------------------------------------------------------------ the reward
    def __call__(self, trajs: Sequence[Any]) -> list[RewardOutput]:
        exs = [t.example for t in trajs]
        chosen = [selected_documents(t, self.keep, self.max_docs) for t in trajs]
        rag = self.rag_documents([ex.question for ex in exs])
        acc = self.accuracy(
            [(ex.question, ex.answers, d) for ex, d in zip(exs, chosen)]
            + [(ex.question, ex.answers, d) for ex, d in zip(exs, rag)]
        )
        n = len(trajs)
        return [
            RewardOutput(
                acc[i] - acc[n + i],
                metrics={"acc_selected": acc[i], "acc_rag": acc[n + i], "docs": float(len(chosen[i]))},
            )
            for i in range(n)
        ]
