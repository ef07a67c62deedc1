"""The Arrow document store: round trips, row access, streaming from a corpus file, retrievers on top of it,
and indexes saved before it (docs.jsonl) still loading."""

import json

import pytest

from searchrl.core.errors import DataError
from searchrl.core.records import Doc
from searchrl.data.corpus import iter_corpus, load_corpus
from searchrl.data.docstore import DocStore, write_docstore
from searchrl.envs.retrievers.bm25 import BM25Retriever


def _docs(n):
    return [Doc(id=f"d{i}", title=f"Title {i}", text=f"text number {i} " + "é" * (i % 3)) for i in range(n)]


def test_round_trip_and_row_access(tmp_path):
    docs = _docs(25)
    assert write_docstore(iter(docs), tmp_path / "s" / "docs.arrow", batch_size=7) == 25  # 4 batches
    store = DocStore(tmp_path / "s" / "docs.arrow")
    assert len(store) == 25 and list(store) == docs
    assert store[0] == docs[0] and store[-1] == docs[24] and store[3:6] == docs[3:6]
    assert store.take([24, 0, 7, 7]) == [docs[24], docs[0], docs[7], docs[7]] and store.take([]) == []
    with pytest.raises(IndexError, match="row 25 out of range for a store of 25"):
        store[25]
    assert not (tmp_path / "s" / "docs.arrow.tmp").exists()
    from datasets import Dataset  # the store is a `datasets` Arrow file

    assert Dataset.from_file(str(tmp_path / "s" / "docs.arrow"))[3] == {
        "id": "d3",
        "title": "Title 3",
        "text": "text number 3 ",
    }


def test_take_copies_only_the_rows_it_returns(tmp_path):
    """A search's rows come from their own record batches: a table-wide take would first concatenate every
    chunk of every column, copying the corpus's text into memory (1.1 GB at 1M passages, measured)."""
    import pyarrow as pa

    docs = [Doc(id=f"d{i}", title=f"T{i}", text="word " * 200) for i in range(3000)]
    write_docstore(docs, tmp_path / "docs.arrow", batch_size=100)  # 30 batches, ~3 MB of text
    store = DocStore(tmp_path / "docs.arrow")
    rows = [2999, 5, 1500, 5, 101]
    before = pa.total_allocated_bytes()
    assert store.take(rows) == [docs[r] for r in rows]
    assert pa.total_allocated_bytes() - before < 100_000
    with pytest.raises(IndexError, match="row 3000 out of range"):
        store.take([1, 3000])


def test_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no documents to store"):
        write_docstore([], tmp_path / "empty.arrow")
    assert not (tmp_path / "empty.arrow").exists() and not (tmp_path / "empty.arrow.tmp").exists()
    with pytest.raises(DataError, match="missing.arrow: document store not found"):
        DocStore(tmp_path / "missing.arrow")
    (tmp_path / "bad.arrow").write_text("not arrow")
    with pytest.raises(DataError, match="bad.arrow: not a document store"):
        DocStore(tmp_path / "bad.arrow")


def test_streamed_from_a_jsonl_corpus(tmp_path, fixtures):
    stream = iter_corpus(fixtures / "corpus.jsonl")
    assert not isinstance(stream, list)  # a generator: the corpus is never a list in memory
    write_docstore(stream, tmp_path / "docs.arrow")
    assert list(DocStore(tmp_path / "docs.arrow")) == load_corpus(fixtures / "corpus.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no documents"):
        list(iter_corpus(tmp_path / "empty.jsonl"))


def test_bm25_index_keeps_documents_in_the_store(tmp_path, fixtures):
    corpus = load_corpus(fixtures / "corpus.jsonl")
    queries = ["capital city", "play by Shakespeare", "Berlin Germany"]
    in_memory = BM25Retriever(corpus)
    in_memory.save(tmp_path / "idx")
    assert (tmp_path / "idx" / "docs.arrow").exists() and not (tmp_path / "idx" / "docs.jsonl").exists()
    loaded = BM25Retriever.load(tmp_path / "idx")
    assert isinstance(loaded.docs, DocStore)
    assert loaded.search(queries, 3) == in_memory.search(queries, 3)  # same documents, same scores
    # saving a retriever whose documents are a store elsewhere copies the file
    loaded.save(tmp_path / "copy")
    assert BM25Retriever.load(tmp_path / "copy").search(queries, 2) == in_memory.search(queries, 2)
    # built over a store directly
    over_store = BM25Retriever(DocStore(tmp_path / "idx" / "docs.arrow"))
    assert over_store.search(queries, 3) == in_memory.search(queries, 3)


def test_index_saved_before_the_store_still_loads(tmp_path, fixtures):
    corpus = load_corpus(fixtures / "corpus.jsonl")
    BM25Retriever(corpus).save(tmp_path / "old")
    (tmp_path / "old" / "docs.arrow").unlink()  # the old layout: documents as JSON lines
    with (tmp_path / "old" / "docs.jsonl").open("w") as f:
        for d in corpus:
            f.write(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n")
    old = BM25Retriever.load(tmp_path / "old")
    assert isinstance(old.docs, list)
    assert old.search(["capital city"], 2) == BM25Retriever(corpus).search(["capital city"], 2)


def test_searchrl_index_writes_the_store(tmp_path, fixtures):
    from searchrl.app.cli import main
    from searchrl.envs.retrievers import build_retriever

    main(["index", "--corpus", str(fixtures / "corpus.jsonl"), "--out", str(tmp_path / "bm25")])
    assert len(DocStore(tmp_path / "bm25" / "docs.arrow")) == len(load_corpus(fixtures / "corpus.jsonl"))
    r = build_retriever("bm25", index=tmp_path / "bm25")
    assert [d.id for d in r.search(["Berlin Germany"], 1)[0]] == ["2"]
