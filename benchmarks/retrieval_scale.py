"""Dense retrieval at a million passages: every faiss index type, built, saved, loaded and queried.

    python benchmarks/retrieval_scale.py --shared-data ../shared/data             # 1M x 768, ~30 min here
    python benchmarks/retrieval_scale.py --n 100000 --parts vectors                # a quicker look

Three parts (``--parts``), each row measured in a fresh process (resident memory is that process's RSS,
Python and imports included; ``rss_baseline_mb`` is the same process before loading):

- ``vectors``: ``--n`` synthetic ``--dim``-d vectors with a cluster structure like sentence embeddings'
  (cluster centres and spread in a low-dimensional subspace with a decaying spectrum, small isotropic
  noise, unit length), kept on disk (memory-mapped). Every ``--specs`` index-factory spec is trained on a
  sample (``data.retrievers.faiss_index.build_index``), saved, loaded memory-mapped where faiss allows,
  and searched with 1,000 queries from the same distribution in batches of 64. Recall@1/5/10 is against
  the exact search (``Flat``, the first spec): the share of the exact top k that the index returns in its
  top k. Embedding a million passages with MiniLM would take hours on 2 cores, hence synthetic vectors.
- ``real``: the same index types (lists scaled to the corpus) on real all-MiniLM-L6-v2 embeddings of the
  real passages in ``--shared-data`` (HotpotQA, MuSiQue, 2Wiki corpora), queried with the real questions of
  every shared dataset: does the recall seen on synthetic vectors hold on real ones?
- ``serve``: the real serving path end to end: a ``dense`` retriever directory holding ``--n`` documents
  (the natural-text document store that ``benchmarks/bm25_engines.py`` builds, made here if absent) and a
  compressed index (``--serve-spec``) over synthetic vectors of the encoder's width, loaded by
  ``build_retriever("dense", index=DIR)`` in a fresh process: start-up time, resident memory, and
  queries/s for real questions (MiniLM encoding + index search + document fetch).

Writes benchmarks/results/retrieval_scale.json and prints markdown tables; the 21M x 768 projection of each
index's memory is in docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bm25_engines import _real_questions, _rss_mb, make_corpus, memory_mb  # noqa: E402  (shared with it)

SPECS = ("Flat", "HNSW32", "IVF4096,SQ8", "IVF4096,PQ96", "IVF4096,PQ128", "OPQ96,IVF4096,PQ96")
BATCH = 64  # queries per search call (a rollout step's batch)
KS = (1, 5, 10)
QUERIES = 1000


def make_vectors(path: Path, n: int, d: int, seed: int, clusters: int = 4096, chunk: int = 50_000) -> None:
    """``n`` unit vectors in a memory-mapped .npy file, and ``QUERIES`` queries beside it."""
    rng = np.random.default_rng(seed)
    r = min(d, 128)  # the subspace that holds most of the variance
    basis = np.linalg.qr(rng.standard_normal((d, r)))[0].T.astype(np.float32)  # (r, d), orthonormal rows
    scale = (np.arange(1, r + 1, dtype=np.float32) ** -0.5).astype(np.float32)  # decaying spectrum
    centres = (rng.standard_normal((clusters, r)) * scale).astype(np.float32)

    def sample(m: int) -> np.ndarray:
        latent = centres[rng.integers(clusters, size=m)] + 0.6 * rng.standard_normal((m, r)) * scale
        x = latent.astype(np.float32) @ basis + rng.standard_normal((m, d)).astype(np.float32) * (
            0.3 / d**0.5
        )
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    if path.exists():
        return
    tmp = path.with_name(path.stem + ".tmp.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, d))
    for start in range(0, n, chunk):
        out[start : start + chunk] = sample(min(chunk, n - start))
    out.flush()
    del out
    np.save(path.with_suffix(".queries.npy"), sample(QUERIES))
    tmp.rename(path)


def build(spec: str, vectors: Path, out: Path, train_size: int) -> dict:
    from searchrl.envs.retrievers.faiss_index import build_index, save_index

    x = np.load(vectors, mmap_mode="r")
    base = _rss_mb()
    t = time.perf_counter()
    index = build_index(x, spec, train_size=train_size)
    build_s = time.perf_counter() - t
    save_index(index, out)
    return {"build_s": build_s, "index_mb": out.stat().st_size / 2**20, "rss_build_mb": _rss_mb() - base}


def knob(spec: str) -> str | None:
    """The query-time parameter of an index type: IVF lists probed, or HNSW's candidate-list size."""
    return "nprobe" if "IVF" in spec else "ef_search" if "HNSW" in spec else None


def serve(
    spec: str,
    index_file: Path,
    queries: Path,
    values: list[int],
    vectors: Path,
    rerank_n: int,
    k: int = max(KS),
) -> dict:
    """Load the index in this (fresh) process, then search every query at each value of its knob; a PQ index
    is also measured with ``rerank_n`` candidates re-scored from the memory-mapped ``vectors``."""
    from searchrl.envs.retrievers.faiss_index import load_index, rerank, set_search_params

    q = np.load(queries)
    base = _rss_mb()
    t = time.perf_counter()
    index = load_index(index_file)
    load_s = time.perf_counter() - t
    x = np.load(vectors, mmap_mode="r")
    runs = []
    modes = [(v, 0) for v in (values if knob(spec) else [None])]
    if "PQ" in spec and rerank_n:
        modes += [(v, rerank_n) for v in values]

    def search(batch: np.ndarray, n_rerank: int) -> np.ndarray:
        if not n_rerank:
            return index.search(batch, k)[1]
        return rerank(x, batch, index.search(batch, n_rerank)[1], k)[1]

    for value, n_rerank in modes:
        if value is not None:
            set_search_params(index, **{knob(spec): value})
        search(q[:BATCH], n_rerank)  # warm-up
        t = time.perf_counter()
        ids = np.concatenate([search(q[i : i + BATCH], n_rerank) for i in range(0, len(q), BATCH)])
        secs = time.perf_counter() - t
        runs.append(
            {
                knob(spec) or "knob": value,
                "rerank": n_rerank,
                "queries_per_s": len(q) / secs,
                "ids": ids.tolist(),
            }
        )
    return {
        "load_s": load_s,
        "rss_baseline_mb": base,
        "rss_serving_mb": _rss_mb(),
        "rss_anon_mb": memory_mb()["anon"],
        "runs": runs,
    }


def recall(ids: list[list[int]], exact: list[list[int]]) -> dict[str, float]:
    return {
        f"recall@{k}": float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(ids, exact)]))
        for k in KS
    }


def _child(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "_child", *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_specs(
    specs: list[str], vectors: Path, queries: Path, work: Path, a: argparse.Namespace, label: str
) -> list[dict]:
    """Build, serve and score every spec on one set of vectors; the first spec is the exact reference."""
    rows: list[dict] = []
    exact: list[list[int]] | None = None
    for spec in specs:
        index_file = work / f"{label}-{spec.replace(',', '_')}.faiss"
        b = (
            {"build_s": None, "index_mb": index_file.stat().st_size / 2**20, "rss_build_mb": None}
            if index_file.exists() and a.reuse
            else _child(["build", spec, str(vectors), str(index_file), str(a.train_size)])
        )
        values = a.nprobe if knob(spec) == "nprobe" else a.ef_search
        s = _child(
            [
                "serve",
                spec,
                str(index_file),
                str(queries),
                ",".join(map(str, values)),
                str(vectors),
                str(a.rerank),
            ]
        )
        n, d = np.load(vectors, mmap_mode="r").shape
        for run in s.pop("runs"):
            ids = run.pop("ids")
            exact = exact if exact is not None else ids
            row = {"part": label, "n": n, "dim": d, "spec": spec, **b, **s, **run, **recall(ids, exact)}
            row["share_of_flat_memory"] = row["index_mb"] / (n * d * 4 / 2**20)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def scale_spec(spec: str, lists: int, width: float) -> str:
    """``spec`` for another corpus: ``lists`` inverted lists, PQ/OPQ bytes scaled by the width ratio."""
    spec = re.sub(r"IVF\d+", f"IVF{lists}", spec)
    return re.sub(r"(PQ)(\d+)", lambda m: f"{m[1]}{max(1, round(int(m[2]) * width))}", spec)


def real_embeddings(shared: Path, work: Path) -> tuple[Path, Path]:
    """MiniLM embeddings of the shared corpora's passages and of every shared dataset's questions."""
    vectors, queries = work / "real.npy", work / "real.queries.npy"
    if vectors.exists() and queries.exists():
        return vectors, queries
    from sentence_transformers import SentenceTransformer

    from searchrl.data.corpus import load_corpus
    from searchrl.envs.retrievers.dense import default_encoder_path

    docs = [d for f in sorted(shared.glob("*/*_corpus.json")) for d in load_corpus(f)]
    enc = SentenceTransformer(default_encoder_path(), device="cpu")

    def embed(texts: list[str]) -> np.ndarray:
        return np.asarray(enc.encode(texts, batch_size=64, normalize_embeddings=True), dtype=np.float32)

    np.save(queries, embed(_real_questions(shared)[:QUERIES]))
    np.save(vectors, embed([f"{d.title}. {d.text}" for d in docs]))
    return vectors, queries


def serve_check(a: argparse.Namespace) -> dict:
    """A dense retriever directory of ``--n`` natural-text documents and a ``--serve-spec`` index over
    synthetic vectors of the encoder's width, loaded and queried through the real retriever class."""
    from searchrl.data.docstore import FILE as STORE_FILE
    from searchrl.envs.retrievers.dense import default_encoder_path
    from searchrl.envs.retrievers.faiss_index import build_index, save_index

    store = a.work / f"natural-{a.n}.arrow"
    questions = make_corpus("natural", a.n, a.shared_data, store)  # reuses bm25_engines' store if present
    d = 384  # all-MiniLM-L6-v2's width
    vectors = a.work / f"vectors-{a.n}x{d}.npy"
    make_vectors(vectors, a.n, d, seed=1)
    folder = a.work / f"dense-{a.n}-{a.serve_spec.replace(',', '_')}"
    t = time.perf_counter()
    if not (folder / "index.faiss").exists():
        folder.mkdir(parents=True, exist_ok=True)
        save_index(
            build_index(np.load(vectors, mmap_mode="r"), a.serve_spec, a.train_size), folder / "index.faiss"
        )
        for name, target in ((STORE_FILE, store), ("embeddings.npy", vectors)):  # as `searchrl index` saves
            (folder / name).unlink(missing_ok=True)
            (folder / name).hardlink_to(target)
        meta = {"retriever": "dense", "encoder": default_encoder_path(), "index_type": a.serve_spec}
        (folder / "index.json").write_text(json.dumps(meta, indent=1))
    build_s = time.perf_counter() - t
    qfile = a.work / "serve.questions.json"
    qfile.write_text(json.dumps(questions[:QUERIES]))
    nprobe = sorted(a.nprobe)[len(a.nprobe) // 2]
    s = _child(["serve-retriever", str(folder), str(qfile), str(nprobe), str(a.rerank)])
    row = {"part": "serve", "n": a.n, "dim": d, "spec": a.serve_spec, "nprobe": nprobe, "rerank": a.rerank}
    row |= {"build_s": build_s, **s}
    row["index_mb"] = (folder / "index.faiss").stat().st_size / 2**20
    row["docs_mb"] = store.stat().st_size / 2**20
    print(json.dumps(row), flush=True)
    return row


def serve_retriever(folder: Path, questions: list[str], nprobe: int, n_rerank: int) -> dict:
    from searchrl.envs.retrievers import build_retriever

    base = _rss_mb()
    t = time.perf_counter()
    r = build_retriever("dense", index=folder, nprobe=nprobe, rerank=n_rerank)
    load_s = time.perf_counter() - t
    r.search(questions[:BATCH], 5)  # warm-up
    t = time.perf_counter()
    n = sum(len(r.search(questions[i : i + BATCH], 5)) for i in range(0, len(questions), BATCH))
    return {
        "load_s": load_s,
        "queries_per_s": n / (time.perf_counter() - t),
        "rss_baseline_mb": base,
        "rss_serving_mb": _rss_mb(),
        "rss_anon_mb": memory_mb()["anon"],
    }


def _knob_text(row: dict) -> str:
    name = knob(row["spec"])
    text = f"{name} {row[name]}" if name else "exact"
    return text + (f", rerank {row['rerank']}" if row.get("rerank") else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--specs", nargs="+", default=list(SPECS), help="faiss index-factory specs; Flat first")
    p.add_argument(
        "--parts", nargs="+", default=["vectors", "real", "serve"], choices=["vectors", "real", "serve"]
    )
    p.add_argument(
        "--nprobe", type=int, nargs="+", default=[16, 64, 256], help="IVF lists probed (each measured)"
    )
    p.add_argument(
        "--ef-search", type=int, nargs="+", default=[64, 256], help="HNSW candidate list (each measured)"
    )
    p.add_argument(
        "--train-size", type=int, default=160_000, help="training sample (IVF4096 wants 39 x 4096)"
    )
    p.add_argument(
        "--rerank", type=int, default=100, help="PQ indexes: also re-score this many candidates exactly"
    )
    p.add_argument("--serve-spec", default="IVF4096,PQ48")
    p.add_argument("--shared-data", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("runs/retrieval_scale"))
    p.add_argument("--reuse", action="store_true", help="serve indexes built by an earlier run")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "retrieval_scale.json")
    a = p.parse_args()
    if a.specs[0] != "Flat":
        p.error("the first spec is the exact reference: Flat")
    if {"real", "serve"} & set(a.parts) and a.shared_data is None:
        p.error("the real and serve parts need --shared-data")
    a.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if "vectors" in a.parts:
        vectors = a.work / f"vectors-{a.n}x{a.dim}.npy"
        make_vectors(vectors, a.n, a.dim, seed=0)
        rows += run_specs(a.specs, vectors, vectors.with_suffix(".queries.npy"), a.work, a, "synthetic")
    if "real" in a.parts:
        vectors, queries = real_embeddings(a.shared_data, a.work)
        n, d = np.load(vectors, mmap_mode="r").shape
        lists = max(16, int(4 * n**0.5) // 16 * 16)  # the usual sqrt rule, for a corpus this size
        specs = [scale_spec(s, lists, d / a.dim) for s in a.specs]
        probes = sorted({max(1, v * lists // 1024) for v in a.nprobe})  # 4x the share: few vectors per list
        real = argparse.Namespace(**{**vars(a), "train_size": n, "nprobe": probes})
        rows += run_specs(specs, vectors, queries, a.work, real, "real")
    if "serve" in a.parts:
        rows.append(serve_check(a))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "machine": "2 CPU cores",
                "batch": BATCH,
                "args": {k: str(v) for k, v in vars(a).items()},
                "rows": rows,
            },
            indent=1,
        )
    )
    print(
        "\n| part | vectors | index | build s | index MB | share of Flat | load s | RSS MB (anonymous) | search | queries/s | R@1 | R@5 | R@10 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["part"] == "serve":
            continue
        build_s = "" if r["build_s"] is None else f"{r['build_s']:.0f}"
        print(
            f"| {r['part']} | {r['n']:,} × {r['dim']} | `{r['spec']}` | {build_s} | {r['index_mb']:.0f} | "
            f"{r['share_of_flat_memory']:.1%} | {r['load_s']:.2f} | {r['rss_serving_mb']:.0f} ({r['rss_anon_mb']:.0f}) | "
            f"{_knob_text(r)} | "
            f"{r['queries_per_s']:,.0f} | {r['recall@1']:.3f} | {r['recall@5']:.3f} | {r['recall@10']:.3f} |"
        )
    for r in rows:
        if r["part"] == "serve":
            print(
                f"\nserving {r['n']:,} documents ({r['docs_mb']:.0f} MB) + `{r['spec']}` ({r['index_mb']:.0f} MB) "
                f"(nprobe {r['nprobe']}, rerank {r['rerank']}) through the dense retriever: start-up {r['load_s']:.1f} s, RSS {r['rss_serving_mb']:.0f} MB, "
                f"{r['queries_per_s']:.0f} questions/s (encoding included)"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        what, rest = sys.argv[2], sys.argv[3:]
        if what == "build":
            res = build(rest[0], Path(rest[1]), Path(rest[2]), int(rest[3]))
        elif what == "serve":
            res = serve(
                rest[0],
                Path(rest[1]),
                Path(rest[2]),
                [int(v) for v in rest[3].split(",")],
                Path(rest[4]),
                int(rest[5]),
            )
        else:
            res = serve_retriever(
                Path(rest[0]), json.loads(Path(rest[1]).read_text()), int(rest[2]), int(rest[3])
            )
        print(json.dumps(res))
    else:
        main()
