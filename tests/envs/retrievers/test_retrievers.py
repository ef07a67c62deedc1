import time

import pytest

from searchrl.core.records import Doc
from searchrl.data.corpus import load_corpus
from searchrl.envs.retrievers import build_retriever
from searchrl.envs.retrievers.bm25 import BM25Retriever
from searchrl.envs.retrievers.cache import CachedRetriever
from searchrl.envs.retrievers.http import HTTPRetriever, RetrieverUnavailable, make_server
from searchrl.envs.retrievers.hybrid import HybridRetriever


@pytest.fixture(scope="module")
def corpus(fixtures):
    return load_corpus(fixtures / "corpus.jsonl")


def ids(rows):
    return [[d.id for d in row] for row in rows]


def test_bm25_batched_ranking(corpus):
    r = BM25Retriever(corpus)
    out = r.search(["capital of France", "Shakespeare tragedy", "zzzz unknownword", ""], 2)
    assert out[0][0].title == "Paris" and out[1][0].title == "Hamlet"
    assert out[2] == [] and out[3] == []  # no overlap / empty query: nothing, never a crash
    assert out[0][0].score > 0 and len(out[0]) <= 2


def test_bm25_save_load_same_results(tmp_path, corpus):
    r = BM25Retriever(corpus)
    r.save(tmp_path / "idx")
    again = BM25Retriever.load(tmp_path / "idx")
    qs = ["capital city", "play by Shakespeare"]
    assert ids(again.search(qs, 3)) == ids(r.search(qs, 3))
    with pytest.raises(FileNotFoundError, match="build the index with `searchrl index --retriever bm25`"):
        BM25Retriever.load(tmp_path / "missing")


def test_build_retriever_builds_then_loads_index(tmp_path, fixtures):
    idx = tmp_path / "bm25"
    a = build_retriever("bm25", corpus=fixtures / "corpus.jsonl", index=idx)
    assert (idx / "index.json").exists()
    b = build_retriever("bm25", index=idx, cache=10)
    assert isinstance(b, CachedRetriever)
    assert ids(b.search(["Berlin Germany"], 1)) == ids(a.search(["Berlin Germany"], 1)) == [["2"]]


def test_dense_and_hybrid(tmp_path, corpus):
    pytest.importorskip("faiss")
    from searchrl.envs.retrievers.dense import DenseRetriever

    d = DenseRetriever(corpus)
    out = d.search(["Which city is the capital of France?", "Who wrote the tragedy Hamlet?"], 2)
    assert out[0][0].title == "Paris" and out[1][0].title == "Hamlet"
    d.save(tmp_path / "dense")
    again = DenseRetriever.load(tmp_path / "dense")
    assert ids(again.search(["German capital"], 2)) == ids(d.search(["German capital"], 2))
    h = HybridRetriever([BM25Retriever(corpus), d], rrf_k=60)
    top = h.search(["Shakespeare play Scotland"], 2)[0]
    assert top[0].title == "Macbeth"


def test_hybrid_rrf_hand_computed():
    class Fixed:
        def __init__(self, order):
            self.order = order

        def search(self, queries, k):
            return [[Doc(id=i, title=i, text="") for i in self.order[:k]] for _ in queries]

    h = HybridRetriever([Fixed(["a", "b", "c"]), Fixed(["c", "a", "d"])], rrf_k=1, depth=3)
    [row] = h.search(["q"], 4)
    # a: 1/2 + 1/3 = .833, c: 1/4 + 1/2 = .75, b: 1/3, d: 1/4
    assert [d.id for d in row] == ["a", "c", "b", "d"]
    assert row[0].score == pytest.approx(1 / 2 + 1 / 3)


def test_cache_hits_and_eviction(corpus):
    class Counting:
        def __init__(self):
            self.seen = []

        def search(self, queries, k):
            self.seen += queries
            return [[Doc(id=q, title=q, text="")] for q in queries]

    inner = Counting()
    c = CachedRetriever(inner, maxsize=2)
    assert ids(c.search(["a", "b", "a"], 1)) == [["a"], ["b"], ["a"]]
    assert inner.seen == ["a", "b"]  # duplicates inside one batch are looked up once
    c.search(["a"], 1)
    assert c.hits == 2 and inner.seen == ["a", "b"]
    c.search(["c"], 1)  # evicts the least recently used ("b")
    c.search(["b"], 1)
    assert inner.seen == ["a", "b", "c", "b"]


def test_http_round_trip_against_real_server(corpus):
    local = BM25Retriever(corpus)
    server = make_server(local, "127.0.0.1", 0).start()
    try:
        client = HTTPRetriever(server.url, timeout=5)
        qs = ["capital of France", "Shakespeare"]
        remote = client.search(qs, 2)
        assert ids(remote) == ids(local.search(qs, 2))
        assert remote[0][0].title == "Paris" and remote[0][0].text.startswith("Paris is the capital")
        assert remote[0][0].score == pytest.approx(local.search(qs, 2)[0][0].score)
    finally:
        server.stop()


def test_http_client_clear_error_when_server_down():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HTTPRetriever(
        f"http://127.0.0.1:{port}/retrieve", timeout=1, retries=2, backoff=0.05, retry_budget_s=0
    )
    t = time.perf_counter()
    with pytest.raises(
        RetrieverUnavailable, match=r"did not answer after 3 attempts(.|\n)*searchrl serve-retriever"
    ):
        client.search(["x"], 1)
    assert time.perf_counter() - t >= 0.05 + 0.1  # it backed off between attempts


INDEX_TYPES = ["Flat", "HNSW32", "IVF4,SQ8", "IVF4,PQ48x4"]  # 4-bit product codes: a corpus of hundreds


@pytest.fixture(scope="module")
def world_docs(small_world):
    return small_world.documents()[:300]  # enough vectors to train 4 IVF lists and 4-bit product codes


@pytest.fixture(scope="module")
def dense_flat(world_docs):
    pytest.importorskip("faiss")
    from searchrl.envs.retrievers.dense import DenseRetriever

    return DenseRetriever(world_docs)


@pytest.mark.parametrize("spec", INDEX_TYPES)
def test_dense_index_types_end_to_end(tmp_path, world_docs, dense_flat, spec):
    """Build, save, load (memory-mapped where faiss allows), search: the same top-1 as Flat on easy queries."""
    from searchrl.envs.retrievers.dense import DenseRetriever

    docs = world_docs[::10]
    queries = [f"{d.title}. {d.text}" for d in docs]  # a document's own text: Flat's top-1 is the document
    r = DenseRetriever(world_docs, embeddings=dense_flat.embeddings, index_type=spec, nprobe=4, ef_search=64)
    assert [row[0].id for row in r.search(queries, 1)] == [row[0].id for row in dense_flat.search(queries, 1)]
    r.save(tmp_path / "idx")
    assert (tmp_path / "idx" / "index.faiss").exists()
    again = DenseRetriever.load(tmp_path / "idx", nprobe=4)
    assert again.index_type == spec and isinstance(again.index, type(r.index))
    assert ids(again.search(queries[:5], 3)) == ids(r.search(queries[:5], 3))


def test_rerank_orders_candidates_by_exact_score():
    import numpy as np

    from searchrl.envs.retrievers.faiss_index import rerank

    vectors = np.array([[1, 0], [0, 1], [0.6, 0.8], [0.8, 0.6]], dtype=np.float32)
    queries = np.array([[1, 0], [0, 1]], dtype=np.float32)
    scores, ids = rerank(vectors, queries, np.array([[1, 2, 3, -1], [-1, -1, -1, -1]]), k=2)
    assert ids.tolist() == [[3, 2], [-1, -1]]  # row 0 is not a candidate; the second query has none
    assert scores[0].tolist() == pytest.approx([0.8, 0.6]) and np.isneginf(scores[1]).all()


def test_pq_index_with_rerank_matches_flat_from_memory_mapped_embeddings(tmp_path, world_docs, dense_flat):
    """4-bit product codes alone reorder the neighbours; re-scoring 150 candidates with the saved (memory-mapped)
    embeddings gives Flat's top 3 on the world's own questions."""
    import numpy as np

    from searchrl.core.errors import DataError
    from searchrl.envs.retrievers.dense import DenseRetriever

    pq = DenseRetriever(world_docs, embeddings=dense_flat.embeddings, index_type="IVF4,PQ48x4", nprobe=4)
    pq.save(tmp_path / "pq")
    again = DenseRetriever.load(tmp_path / "pq", nprobe=4, rerank=150)
    assert isinstance(again.embeddings, np.memmap)
    queries = [d.text.split(".")[1] for d in world_docs[::7]]  # one sentence of a document: several near ties
    exact = ids(dense_flat.search(queries, 3))
    assert ids(pq.search(queries, 3)) != exact
    assert ids(again.search(queries, 3)) == exact
    (tmp_path / "pq" / "embeddings.npy").unlink()
    with pytest.raises(DataError, match="rerank re-scores candidates with the stored embeddings"):
        DenseRetriever.load(tmp_path / "pq", rerank=20)


@pytest.mark.slow  # OPQ's rotation is trained with 8-bit codebooks: about a minute on 2 cores
def test_opq_ivf_pq_same_top1_as_flat():
    """OPQ + IVF + PQ, the most compressed family, on clustered synthetic vectors (OPQ needs at least d
    training vectors, more than a small test corpus has): the same top-1 as exact search on easy queries."""
    faiss = pytest.importorskip("faiss")
    import numpy as np

    from searchrl.envs.retrievers.faiss_index import build_index, set_search_params

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((8, 32))
    x = (centres[rng.integers(0, 8, 600)] + 0.5 * rng.standard_normal((600, 32))).astype(np.float32)
    faiss.normalize_L2(x)
    exact = build_index(x, "Flat").search(x[:100], 1)[1]
    index = build_index(x, "OPQ16,IVF4,PQ16")
    set_search_params(index, nprobe=4)
    assert index.search(x[:100], 1)[1][:, 0].tolist() == exact[:, 0].tolist()
    assert index.sa_code_size() == 16 + 1  # 16 bytes of codes (+ 1 for the list number) vs Flat's 128


def test_dense_index_errors_and_old_format(tmp_path, fixtures, world_docs, dense_flat, capsys):
    import json

    import numpy as np

    from searchrl.app.cli import main
    from searchrl.core.errors import DataError
    from searchrl.envs.retrievers.dense import DenseRetriever

    with pytest.raises(DataError, match="cannot build index type 'IVF4,PQ7'.*PQ m must divide"):
        DenseRetriever(world_docs, embeddings=dense_flat.embeddings, index_type="IVF4,PQ7")  # 384 % 7 != 0
    # an index saved before index types existed: embeddings and docs only -> loads as Flat
    old = tmp_path / "old"
    dense_flat.save(old)
    (old / "index.faiss").unlink()
    meta = json.loads((old / "index.json").read_text())
    del meta["index_type"]
    (old / "index.json").write_text(json.dumps(meta))
    loaded = DenseRetriever.load(old)
    assert loaded.index_type == "Flat" and ids(loaded.search(["capital of France"], 2)) == ids(
        dense_flat.search(["capital of France"], 2)
    )
    # another index type from the saved embeddings
    hnsw = DenseRetriever.load(old, index_type="HNSW32")
    assert type(hnsw.index).__name__ == "IndexHNSWFlat"
    assert isinstance(loaded.embeddings, np.memmap)  # not read into memory at load
    main(
        [
            "index",
            "--retriever",
            "dense",
            "--corpus",
            str(fixtures / "corpus.jsonl"),
            "--out",
            str(tmp_path / "x"),
            "--index-type",
            "IVF4,SQ8",
        ]
    )
    assert json.loads((tmp_path / "x" / "index.json").read_text())["index_type"] == "IVF4,SQ8"
    assert type(DenseRetriever.load(tmp_path / "x").index).__name__ == "IndexIVFScalarQuantizer"
    with pytest.raises(SystemExit):
        main(
            [
                "index",
                "--corpus",
                str(fixtures / "corpus.jsonl"),
                "--out",
                str(tmp_path / "y"),
                "--index-type",
                "HNSW32",
            ]
        )
    assert "--index-type is for the dense retriever" in capsys.readouterr().err
