"""BM25 over a corpus with bm25s (sparse, in-process, fast on a CPU)."""

from __future__ import annotations

import importlib.abc
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.corpus import load_corpus
from searchrl.data.docstore import FILE as STORE_FILE
from searchrl.data.docstore import DocStore, write_docstore


class _HideJax(importlib.abc.MetaPathFinder):
    """Makes ``import jax`` fail while it is on ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "jax" or name.startswith("jax."):
            raise ModuleNotFoundError(f"searchrl hides {name} while bm25s is imported", name=name)


def import_bm25s() -> Any:
    """bm25s, imported without JAX. bm25s imports JAX when it is installed and runs a top-k at import, which
    starts JAX's default backend: on a GPU node with a CUDA jaxlib, XLA then preallocates 75% of the GPU's
    memory in the training process (measured on an H100: 60 of 79 GB gone before the first step, and a
    1.5B-shape GRPO step out of memory). Our retrievers score with numpy or numba, never JAX, so
    bm25s is imported with JAX hidden, unless JAX is loaded already (the user's own choice)."""
    if "bm25s" in sys.modules or "jax" in sys.modules:
        import bm25s

        return bm25s
    hide = _HideJax()
    sys.meta_path.insert(0, hide)
    try:
        import bm25s
    finally:
        sys.meta_path.remove(hide)
    return bm25s


class BM25Retriever:
    """Lucene-style BM25 (k1, b) over title + text. English stop words are removed.

    ``backend: numba`` scores with bm25s's compiled kernels (needs numba) and ``threads`` runs a batch's queries
    on that many threads (-1: every core; 0: in the calling thread). A loaded index is memory-mapped."""

    def __init__(
        self,
        docs: Sequence[Doc],
        k1: float = 0.9,
        b: float = 0.4,
        method: str = "lucene",
        backend: Literal["numpy", "numba"] = "numpy",
        threads: int = 0,
    ) -> None:
        bm25s = import_bm25s()

        if not docs:
            raise DataError("BM25Retriever needs a non-empty corpus")
        if backend not in ("numpy", "numba"):
            raise DataError(f"bm25 backend must be 'numpy' or 'numba', got {backend!r}")
        self.docs = docs
        self.params = {"k1": k1, "b": b, "method": method}
        self.backend, self.threads = backend, threads
        self._model = bm25s.BM25(k1=k1, b=b, method=method, backend=backend)
        tokens = bm25s.tokenize([f"{d.title} {d.text}" for d in docs], stopwords="en", show_progress=False)
        self._model.index(tokens, show_progress=False)

    @classmethod
    def from_corpus(cls, corpus: str | Path, **kwargs: Any) -> BM25Retriever:
        return cls(load_corpus(corpus), **kwargs)

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        bm25s = import_bm25s()

        if not queries:
            return []
        k = min(k, len(self.docs))
        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False, return_ids=False)
        # bm25s cannot score an empty query; those get no documents.
        nonempty = [i for i, t in enumerate(tokens) if t]
        out: list[list[Doc]] = [[] for _ in queries]
        if nonempty:
            idx, scores = self._model.retrieve(
                [tokens[i] for i in nonempty],
                k=k,
                show_progress=False,
                n_threads=self.threads,
                backend_selection=self.backend,
            )
            hits = [
                [(int(j), float(s)) for j, s in zip(np.asarray(idx[row]), np.asarray(scores[row])) if s > 0.0]
                for row in range(len(nonempty))
            ]
            for qi, docs in zip(nonempty, fetch(self.docs, hits)):
                out[qi] = docs
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._model.save(str(path / "bm25s"), show_progress=False)
        _save_docs(path, self.docs, {"retriever": "bm25", **self.params})

    @classmethod
    def load(
        cls, path: str | Path, backend: Literal["numpy", "numba"] = "numpy", threads: int = 0, **_: Any
    ) -> BM25Retriever:
        bm25s = import_bm25s()

        path = Path(path)
        obj = cls.__new__(cls)
        obj.docs, meta = _load_docs(path, "bm25")
        obj.params = {k: meta[k] for k in ("k1", "b", "method")}
        obj.backend, obj.threads = backend, threads
        obj._model = bm25s.BM25.load(str(path / "bm25s"), show_progress=False, mmap=True)
        obj._model.backend = backend
        return obj


def fetch(docs: Sequence[Doc], hits: list[list[tuple[int, float]]]) -> list[list[Doc]]:
    """Each query's (row, score) hits as documents carrying their scores; a `DocStore` reads every row of the
    batch in one go."""
    rows = [j for q in hits for j, _ in q]
    found = iter(docs.take(rows) if isinstance(docs, DocStore) else [docs[j] for j in rows])
    return [[replace(next(found), score=s) for _, s in q] for q in hits]


def _save_docs(path: Path, docs: Sequence[Doc], meta: dict[str, Any]) -> None:
    """The documents as an Arrow store (`data.docstore`) beside the index, and the index's metadata."""
    target = path / STORE_FILE
    if isinstance(docs, DocStore):
        if docs.path.resolve() != target.resolve():
            shutil.copyfile(docs.path, target)
    else:
        write_docstore(docs, target, progress=len(docs) > 100_000)
    (path / "docs.jsonl").unlink(missing_ok=True)  # the pre-store format, superseded
    (path / "index.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")


def _load_docs(path: Path, kind: str) -> tuple[Sequence[Doc], dict[str, Any]]:
    """The saved documents, memory-mapped (indexes saved before the store, with docs.jsonl, still load)."""
    meta_file = path / "index.json"
    if not meta_file.exists():
        raise FileNotFoundError(
            f"{meta_file} not found: build the index with `searchrl index --retriever {kind}`"
        )
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("retriever") != kind:
        raise ValueError(f"{path} holds a {meta.get('retriever')!r} index, not {kind!r}")
    if (path / STORE_FILE).exists():
        return DocStore(path / STORE_FILE), meta
    with (path / "docs.jsonl").open(encoding="utf-8") as f:
        docs = [Doc(**json.loads(line)) for line in f if line.strip()]
    return docs, meta
