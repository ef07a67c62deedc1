"""The retriever protocol and registry. Every retriever is batched: ``search(queries, k)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from searchrl.core.records import Doc
from searchrl.core.registry import Registry


@runtime_checkable
class Retriever(Protocol):
    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        """Top-``k`` documents for each query, best first."""
        ...


class IndexedRetriever(Retriever, Protocol):
    """A retriever whose index can be saved and loaded back (``searchrl index``)."""

    def save(self, path: str | Path) -> None: ...

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> IndexedRetriever: ...


RETRIEVERS: Registry[Any] = Registry("retriever")
# Built-ins are lazy so that `searchrl validate` can check names without importing faiss or torch.
RETRIEVERS.add_lazy("bm25", "searchrl.envs.retrievers.bm25:BM25Retriever")
RETRIEVERS.add_lazy("dense", "searchrl.envs.retrievers.dense:DenseRetriever")
RETRIEVERS.add_lazy("hybrid", "searchrl.envs.retrievers.hybrid:HybridRetriever")
RETRIEVERS.add_lazy("http", "searchrl.envs.retrievers.http:HTTPRetriever")
RETRIEVERS.add_lazy("simulated", "searchrl.envs.retrievers.simulated:SimulatedRetriever")
RETRIEVERS.add_lazy("tantivy", "searchrl.envs.retrievers.tantivy_bm25:TantivyRetriever")
