"""BM25 over a corpus with bm25s (sparse, in-process, fast on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from searchrl.data.corpus import Doc, load_corpus
from searchrl.errors import DataError


class BM25Retriever:
    """Lucene-style BM25 (k1, b) over title + text. English stop words are removed."""

    def __init__(self, docs: list[Doc], k1: float = 0.9, b: float = 0.4, method: str = "lucene") -> None:
        import bm25s

        if not docs:
            raise DataError("BM25Retriever needs a non-empty corpus")
        self.docs = docs
        self.params = {"k1": k1, "b": b, "method": method}
        self._model = bm25s.BM25(k1=k1, b=b, method=method)
        tokens = bm25s.tokenize([f"{d.title} {d.text}" for d in docs], stopwords="en", show_progress=False)
        self._model.index(tokens, show_progress=False)

    @classmethod
    def from_corpus(cls, corpus: str | Path, **kwargs: Any) -> BM25Retriever:
        return cls(load_corpus(corpus), **kwargs)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        import bm25s

        if not queries:
            return []
        k = min(k, len(self.docs))
        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False, return_ids=False)
        # bm25s cannot score an empty query; those get no documents.
        nonempty = [i for i, t in enumerate(tokens) if t]
        out: list[list[Doc]] = [[] for _ in queries]
        if nonempty:
            idx, scores = self._model.retrieve(
                [tokens[i] for i in nonempty], k=k, show_progress=False, n_threads=0
            )
            for row, qi in enumerate(nonempty):
                out[qi] = [
                    _with_score(self.docs[int(j)], float(s))
                    for j, s in zip(np.asarray(idx[row]), np.asarray(scores[row]))
                    if float(s) > 0.0
                ]
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._model.save(str(path / "bm25s"), show_progress=False)
        _save_docs(path, self.docs, {"retriever": "bm25", **self.params})

    @classmethod
    def load(cls, path: str | Path, **_: Any) -> BM25Retriever:
        import bm25s

        path = Path(path)
        obj = cls.__new__(cls)
        obj.docs, meta = _load_docs(path, "bm25")
        obj.params = {k: meta[k] for k in ("k1", "b", "method")}
        obj._model = bm25s.BM25.load(str(path / "bm25s"), show_progress=False)
        return obj


def _with_score(doc: Doc, score: float) -> Doc:
    return Doc(id=doc.id, title=doc.title, text=doc.text, score=score)


def _save_docs(path: Path, docs: list[Doc], meta: dict[str, Any]) -> None:
    with (path / "docs.jsonl").open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False) + "\n")
    (path / "index.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")


def _load_docs(path: Path, kind: str) -> tuple[list[Doc], dict[str, Any]]:
    meta_file = path / "index.json"
    if not meta_file.exists():
        raise FileNotFoundError(
            f"{meta_file} not found: build the index with `searchrl index --retriever {kind}`"
        )
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("retriever") != kind:
        raise ValueError(f"{path} holds a {meta.get('retriever')!r} index, not {kind!r}")
    with (path / "docs.jsonl").open(encoding="utf-8") as f:
        docs = [Doc(**json.loads(line)) for line in f if line.strip()]
    return docs, meta
