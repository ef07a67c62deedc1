"""Hybrid retrieval by reciprocal-rank fusion (as RAG-Gym combines BM25 and dense retrievers)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from searchrl.core.records import Doc
from searchrl.envs.retrievers.protocol import Retriever


class HybridRetriever:
    """score(d) = sum over retrievers of 1 / (rrf_k + rank(d)), rank from 1 (Cormack et al., 2009)."""

    def __init__(self, retrievers: list[Retriever], rrf_k: int = 60, depth: int = 20) -> None:
        if not retrievers:
            raise ValueError("HybridRetriever needs at least one retriever")
        self.retrievers, self.rrf_k, self.depth = retrievers, rrf_k, depth

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        depth = max(k, self.depth)
        ranked_lists = [r.search(queries, depth) for r in self.retrievers]
        out = []
        for qi in range(len(queries)):
            scores: dict[str, float] = defaultdict(float)
            docs: dict[str, Doc] = {}
            for ranked in ranked_lists:
                for rank, doc in enumerate(ranked[qi], 1):
                    scores[doc.id] += 1.0 / (self.rrf_k + rank)
                    docs.setdefault(doc.id, doc)
            best = sorted(scores, key=lambda d: (-scores[d], d))[:k]
            out.append([replace(docs[d], score=scores[d]) for d in best])
        return out
