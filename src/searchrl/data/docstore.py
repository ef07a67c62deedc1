"""Documents on disk: one Arrow file in the `datasets` format, memory-mapped and read by row.

A retriever keeps a `DocStore` instead of a list of `Doc`: opening it maps the file instead of parsing it, so
start-up time and resident memory do not grow with the corpus's text (only the pages a search touches are
read). It is a ``Sequence[Doc]``, so code written for a list of documents works on it unchanged; ``take``
fetches a batch of rows in one read.

    write_docstore(iter_corpus("wiki-18.jsonl"), "index/docs.arrow")   # streamed, never all in memory
    store = DocStore("index/docs.arrow")
    store.take([17, 4_000_001])                                          # -> [Doc, Doc]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from searchrl.core.errors import DataError
from searchrl.core.records import Doc

FILE = "docs.arrow"  # the store's file name inside an index directory
_COLUMNS = ("id", "title", "text")


def _features() -> Any:
    from datasets import Features, Value

    return Features({c: Value("string") for c in _COLUMNS})


def write_docstore(
    docs: Iterable[Doc], path: str | Path, batch_size: int = 10_000, progress: bool = False
) -> int:
    """Write ``docs`` (any iterable: a list, a `DocStore`, `iter_corpus`'s stream) to an Arrow file at
    ``path``, ``batch_size`` rows at a time. Returns the number of documents."""
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    cols: dict[str, list[str]] = {c: [] for c in _COLUMNS}
    with ArrowWriter(features=_features(), path=str(tmp)) as writer:
        # shown after 2 s: a small corpus, or one that fails early, prints no bar before its message
        for d in tqdm(docs, desc="documents", unit="doc", disable=not progress, mininterval=2.0, delay=2.0):
            cols["id"].append(d.id)
            cols["title"].append(d.title)
            cols["text"].append(d.text)
            n += 1
            if len(cols["id"]) >= batch_size:
                writer.write_batch(cols)
                cols = {c: [] for c in _COLUMNS}
        if cols["id"]:
            writer.write_batch(cols)
        writer.finalize()
    if n == 0:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path}: no documents to store (the corpus is empty)")
    tmp.replace(path)  # a store is complete or absent, never half-written
    return n


class DocStore(Sequence[Doc]):
    """A memory-mapped Arrow file of documents (columns id, title, text), read by row."""

    def __init__(self, path: str | Path) -> None:
        import pyarrow as pa

        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: document store not found; build it with `searchrl index`")
        # read as `datasets.Dataset.from_file` does (an Arrow stream over a memory map, zero-copy), without
        # importing `datasets` (~90 MB resident) into a retrieval server
        try:
            self._table = pa.ipc.open_stream(pa.memory_map(str(self.path))).read_all()
        except pa.ArrowInvalid as exc:
            raise DataError(f"{self.path}: not a document store ({exc})") from None
        missing = [c for c in _COLUMNS if c not in self._table.column_names]
        if missing:
            raise DataError(f"{self.path}: not a document store (no column {', '.join(missing)})")
        # rows are taken from the record batch that holds them: `Table.take` concatenates a column's chunks
        # first, i.e. copies the whole corpus's text into memory at the first search
        self._batches = self._table.to_batches()
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])

    def __len__(self) -> int:
        return self._table.num_rows

    def duplicate_ids(self, limit: int = 10) -> list[str]:
        """Up to ``limit`` ids that more than one document has (counted in Arrow, not in Python objects)."""
        import pyarrow.compute as pc

        ids = self._table.column("id")
        if pc.count_distinct(ids).as_py() == len(ids):
            return []
        counts = pc.value_counts(ids)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))
        return [str(v) for v in dup.field("values")[:limit].to_pylist()]

    @overload
    def __getitem__(self, i: int) -> Doc: ...

    @overload
    def __getitem__(self, i: slice) -> list[Doc]: ...

    def __getitem__(self, i: int | slice) -> Doc | list[Doc]:
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document row {i} out of range for a store of {n}")
        return self._rows(self._table.slice(i % n, 1))[0]

    def take(self, rows: Sequence[int]) -> list[Doc]:
        """The documents at ``rows`` (in that order), in one read."""
        if len(rows) == 0:
            return []
        idx = np.asarray(rows, dtype=np.int64)
        bad = (idx < 0) | (idx >= len(self))
        if bad.any():
            raise IndexError(f"document row {int(idx[bad][0])} out of range for a store of {len(self)}")
        batch = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Doc | None] = [None] * len(idx)
        for b in np.unique(batch):
            where = np.flatnonzero(batch == b)
            for i, doc in zip(where, self._rows(self._batches[b].take(idx[where] - self._starts[b]))):
                out[i] = doc
        return out  # type: ignore[return-value]  # every slot filled

    def __iter__(self) -> Iterator[Doc]:
        for batch in self._table.to_batches(max_chunksize=10_000):
            yield from self._rows(batch)

    @staticmethod
    def _rows(table: Any) -> list[Doc]:
        cols = [table.column(c).to_pylist() for c in _COLUMNS]
        return [Doc(id=i, title=t, text=x) for i, t, x in zip(*cols)]

    def nbytes(self) -> int:
        """Size of the stored documents (on disk; mapped, not resident)."""
        return int(self._table.nbytes)
