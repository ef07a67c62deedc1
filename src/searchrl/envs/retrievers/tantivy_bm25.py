"""BM25 at millions of passages with tantivy (Rust, Lucene-like): an on-disk, memory-mapped inverted index,
top-k by block-max WAND (documents that cannot enter the top k are skipped, not scored), queries on several
threads. ``bm25`` (bm25s) scores every posting of every query term, in process; it stays the default for
small corpora, where it is as fast. Measurements: benchmarks/bm25_engines.py, docs/scaling.md.

Text is analysed exactly as bm25s does it (`analyse`), so the two engines index the same terms; tantivy's BM25
constants are its own (k1 = 1.2, b = 0.75; ``bm25`` here: 0.9, 0.4), and it stores document lengths in one
byte (as Lucene does), so scores differ slightly from bm25s's with the same constants.
Install with ``pip install 'searchrl[scale]'``.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.envs.retrievers.bm25 import _load_docs, _save_docs, fetch

_ANALYZER = "searchrl_en"
_SUBDIR = "tantivy"


def _tantivy() -> Any:
    try:
        import tantivy
    except ImportError as exc:
        raise ImportError(
            "the tantivy retriever needs tantivy: pip install 'searchrl[scale]' (or pip install tantivy)"
        ) from exc
    return tantivy


_TOKEN = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default token pattern


@lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    from searchrl.envs.retrievers.bm25 import import_bm25s

    return frozenset(import_bm25s().stopwords.STOPWORDS_EN)


def analyse(text: str) -> str:
    """The text as bm25s sees it (lowercase words of 2+ characters, bm25s's English stop words removed),
    space-separated: tantivy then only splits on spaces, and both engines index the same terms."""
    stop = _stopwords()
    return " ".join(t for t in _TOKEN.findall(text.lower()) if t not in stop)


def _register(index: Any) -> None:
    """The analyser is not stored in the index: register it on every open."""
    tv = _tantivy()
    index.register_tokenizer(_ANALYZER, tv.TextAnalyzerBuilder(tv.Tokenizer.whitespace()).build())


def _schema() -> Any:
    b = _tantivy().SchemaBuilder()
    b.add_unsigned_field("row", stored=False, fast=True)
    b.add_text_field("body", stored=False, tokenizer_name=_ANALYZER, index_option="freq")
    return b.build()


class TantivyRetriever:
    """BM25 top-k with tantivy over documents kept in a `DocStore` (or a list)."""

    def __init__(
        self,
        docs: Sequence[Doc],
        threads: int = 2,
        heap_mb: int = 512,
        index_dir: str | Path | None = None,
        tantivy_index: Any = None,  # an opened index (`load`)
    ) -> None:
        if not docs:
            raise DataError("TantivyRetriever needs a non-empty corpus")
        self.docs, self.threads = docs, max(1, threads)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if tantivy_index is None:
            if index_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="searchrl-tantivy-")
                index_dir = self._tmp.name
            tantivy_index = self._build(docs, Path(index_dir), heap_mb)
        self.index_dir = Path(index_dir) if index_dir is not None else None
        self.index = tantivy_index
        self.searcher = self.index.searcher()
        if self.searcher.num_docs != len(docs):
            raise DataError(f"the tantivy index holds {self.searcher.num_docs} documents for {len(docs)}")
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def _build(self, docs: Sequence[Doc], path: Path, heap_mb: int) -> Any:
        from tqdm.auto import tqdm

        tv = _tantivy()
        path.mkdir(parents=True, exist_ok=True)
        index = tv.Index(_schema(), path=str(path), reuse=False)
        _register(index)
        writer = index.writer(heap_size=heap_mb * 1_000_000, num_threads=self.threads)
        for row, d in enumerate(
            tqdm(docs, desc="tantivy index", unit="doc", disable=len(docs) < 100_000, mininterval=2.0)
        ):
            doc = tv.Document()
            doc.add_unsigned("row", row)
            doc.add_text("body", analyse(f"{d.title} {d.text}"))
            writer.add_document(doc)
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        return index

    def _one(self, query: str, k: int) -> list[tuple[int, float]]:
        terms = analyse(query)
        if not terms:
            return []
        q, _errors = self.index.parse_query_lenient(terms, ["body"])
        hits = self.searcher.search(q, k, count=False).hits
        rows = self.searcher.fast_field_values("row", [addr for _, addr in hits])  # no stored-document reads
        return [(int(r), float(score)) for (score, _), r in zip(hits, rows)]

    def search(self, queries: list[str], k: int) -> list[list[Doc]]:
        if not queries:
            return []
        k = min(k, len(self.docs))
        run = (lambda q: self._one(q, k)) if k > 0 else (lambda q: [])
        hits = list(self._pool.map(run, queries)) if self._pool else [run(q) for q in queries]
        return fetch(self.docs, hits)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        target = path / _SUBDIR
        if self.index_dir is None or self.index_dir.resolve() != target.resolve():
            if target.exists():
                shutil.rmtree(target)
            assert self.index_dir is not None
            shutil.copytree(self.index_dir, target)
        _save_docs(path, self.docs, {"retriever": "tantivy", "threads": self.threads})

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, **_: Any) -> TantivyRetriever:
        path = Path(path)
        docs, meta = _load_docs(path, "tantivy")
        index = _tantivy().Index.open(str(path / _SUBDIR))
        _register(index)
        return cls(
            docs,
            threads=threads or int(meta.get("threads", 2)),
            index_dir=path / _SUBDIR,
            tantivy_index=index,
        )

    def __repr__(self) -> str:
        return f"TantivyRetriever({len(self.docs)} documents, {self.threads} threads)"


def index_files(path: str | Path) -> dict[str, Any]:
    """What a saved tantivy index holds, for reports: segment count and bytes on disk."""
    root = Path(path) / _SUBDIR
    meta = json.loads((root / "meta.json").read_text())
    return {"segments": len(meta.get("segments", [])), "bytes": sum(f.stat().st_size for f in root.iterdir())}
