"""The large-corpus BM25 engines: tantivy (registered as `tantivy`) and bm25s's numba backend on threads."""

from itertools import pairwise

import bm25s
import pytest

from searchrl.data.corpus import load_corpus
from searchrl.data.docstore import DocStore
from searchrl.envs.retrievers import build_retriever
from searchrl.envs.retrievers.bm25 import BM25Retriever
from searchrl.envs.retrievers.tantivy_bm25 import TantivyRetriever, analyse

QUERIES = ["capital city", "play by Shakespeare", "Berlin Germany", "What is the capital of France?"]


@pytest.fixture(scope="module")
def corpus(fixtures):
    return load_corpus(fixtures / "corpus.jsonl")


def ids(rows):
    return [[d.id for d in r] for r in rows]


def test_analyse_gives_bm25s_terms():
    text = "The Eiffel Tower's height: 330 m (1,083 ft), a world-record in 1889! I a"
    assert analyse(text).split() == bm25s.tokenize([text], stopwords="en", return_ids=False)[0]


def test_tantivy_ranks_like_bm25_and_survives_query_syntax(corpus):
    t, b = TantivyRetriever(corpus, threads=1), BM25Retriever(corpus, k1=1.2, b=0.75)
    assert [r[0] for r in ids(t.search(QUERIES, 3))] == [r[0] for r in ids(b.search(QUERIES, 3))]
    out = t.search(['what? (is) "the" : AND', "", "zzzz"], 3)
    assert out == [[], [], []]  # only stop words / nothing / no match: no documents, never a parse error
    hit = t.search(["Berlin Germany"], 5)[0]
    assert hit[0].id == "2" and hit[0].score > 0 and all(a.score >= c.score for a, c in pairwise(hit))


def test_tantivy_threads_and_k(corpus):
    one, two = TantivyRetriever(corpus, threads=1), TantivyRetriever(corpus, threads=2)
    assert two.search(QUERIES * 10, 2) == one.search(QUERIES * 10, 2)
    assert all(len(r) <= 2 for r in two.search(QUERIES, 2)) and one.search(QUERIES, 0) == [[]] * 4


def test_tantivy_save_load_with_the_document_store(tmp_path, corpus):
    built = build_retriever("tantivy", corpus=corpus, index=tmp_path / "idx")
    assert (tmp_path / "idx" / "tantivy" / "meta.json").exists() and (
        tmp_path / "idx" / "docs.arrow"
    ).exists()
    loaded = build_retriever("tantivy", index=tmp_path / "idx", threads=2)
    assert isinstance(loaded, TantivyRetriever) and isinstance(loaded.docs, DocStore)
    assert loaded.search(QUERIES, 3) == built.search(QUERIES, 3)


def test_searchrl_index_builds_tantivy(tmp_path, fixtures, corpus):
    from searchrl.app.cli import main

    main(
        [
            "index",
            "--retriever",
            "tantivy",
            "--corpus",
            str(fixtures / "corpus.jsonl"),
            "--out",
            str(tmp_path),
        ]
    )
    assert ids(build_retriever("tantivy", index=tmp_path).search(QUERIES, 2)) == ids(
        TantivyRetriever(corpus).search(QUERIES, 2)
    )


def test_bm25s_numba_backend_on_threads_same_results(tmp_path, corpus):
    exact = BM25Retriever(corpus)
    fast = BM25Retriever(corpus, backend="numba", threads=-1)
    assert fast.search(QUERIES * 5, 3) == exact.search(QUERIES * 5, 3)
    exact.save(tmp_path / "idx")
    loaded = build_retriever("bm25", index=tmp_path / "idx", backend="numba", threads=2)
    assert loaded.search(QUERIES, 3) == exact.search(QUERIES, 3)
