"""BM25 engines at 100k and 1M passages: build time, index size, start-up, resident memory, queries/s.

    python benchmarks/bm25_engines.py --sizes 100000 1000000 --shared-data ../shared/data

Two corpora per size, each written once to a document store (data.docstore) under --work:
- ``random`` (worst case): 60-word passages of words drawn uniformly from the synthetic world's vocabulary
  (~1,900 words), 5-word random queries: every query term has a posting list of ~15% of the corpus.
- ``natural``: the real passages of ../shared/data (HotpotQA, MuSiQue, 2Wiki; ~9k), then generated passages
  whose words are drawn from those passages' word frequencies (Zipfian, stop words included) with their
  lengths; queries are the real questions of every shared dataset.

Engines are our registered retrievers: ``bm25`` (bm25s, numpy, one thread — today's default), ``bm25`` with
``backend: numba, threads: -1`` (the same index, served otherwise: its build row repeats the first's), and
``tantivy`` (2 threads). Each is built in one process (once: ``WORK/INDEX.build.json`` records it and later
runs reuse the index), then loaded and queried in a fresh one. Resident memory is that process's RSS after the
queries, Python and imports included; ``rss_anon_mb`` is the part it allocated, the rest being pages of the
memory-mapped document store and index that the queries touched (page cache, reclaimed under memory pressure);
``rss_baseline_mb`` is the same process before loading. Top-5 agreement is measured against exact bm25s scoring with
the same BM25 constants (tantivy's are k1 1.2, b 0.75). Writes benchmarks/results/bm25_engines.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = {  # name: (retriever, build args, serving args); engines with the same build share one index
    "bm25s-numpy-1t": ("bm25", {}, {}),
    "bm25s-numba-2t": ("bm25", {}, {"backend": "numba", "threads": -1}),
    # exact BM25 with tantivy's constants: the reference that tantivy's top-k is checked against
    "bm25s-numba-2t-k1.2-b0.75": ("bm25", {"k1": 1.2, "b": 0.75}, {"backend": "numba", "threads": -1}),
    "tantivy-2t": ("tantivy", {"threads": 2}, {"threads": 2}),
}


def index_name(engine: str) -> str:
    name, build_args, _ = ENGINES[engine]
    return "-".join([name, *(f"{k}{v}" for k, v in sorted(build_args.items()))])


REFERENCE = {"tantivy-2t": "bm25s-numba-2t-k1.2-b0.75"}  # default: bm25s-numpy-1t (k1 0.9, b 0.4)
BATCH = 64  # queries per search call (a rollout step's batch)


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9]+(?:'[a-z]+)?", text)


def make_corpus(kind: str, size: int, shared: Path | None, out: Path, seed: int = 0) -> list[str]:
    """Write the corpus's document store (if absent) and return its queries."""
    from searchrl.core.records import Doc
    from searchrl.data.corpus import load_corpus
    from searchrl.data.docstore import write_docstore

    rng = random.Random(seed)
    queries_file = out.with_suffix(".queries.json")
    if kind == "random":
        from searchrl.envs.synthetic.world import World, WorldConfig

        vocab = sorted({w for d in World.generate(WorldConfig(seed=0)).documents() for w in _words(d.text)})
        if not out.exists():
            docs = (Doc(str(i), f"doc {i}", " ".join(rng.choices(vocab, k=60))) for i in range(size))
            write_docstore(docs, out, progress=True)
        queries = [" ".join(rng.choices(vocab, k=5)) for _ in range(1000)]
    else:
        if shared is None:
            raise SystemExit("the natural corpus needs --shared-data")
        real = [
            d
            for f in (
                "hotpotqa/hipporag_hotpotqa_train_100_corpus.json",
                "musique/hipporag_musique_train_100_corpus.json",
                "2wikimultihopqa/hipporag_2wiki_dev_1000_corpus.json",
            )
            for d in load_corpus(shared / f)
        ]
        queries = _real_questions(shared)
        if not out.exists():
            tokens = [_words(f"{d.title} {d.text}") for d in real]
            pool = [w for t in tokens for w in t]  # word frequencies of real text
            lengths = [len(t) for t in tokens]

            def gen():
                for i, d in enumerate(real):
                    yield Doc(f"real-{i}", d.title, d.text)
                for i in range(size - len(real)):
                    words = rng.choices(pool, k=rng.choice(lengths))
                    yield Doc(f"gen-{i}", " ".join(words[:3]), " ".join(words[3:]))

            write_docstore(gen(), out, progress=True)
    queries_file.write_text(json.dumps(queries))
    return queries


def _real_questions(shared: Path) -> list[str]:
    qs: list[str] = []
    for f in sorted(shared.glob("*/*.jsonl")) + sorted(shared.glob("*/hipporag_*_train_100.json")):
        rows = (
            [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            if f.suffix == ".jsonl"
            else json.loads(f.read_text())
        )
        qs += [r["question"] for r in rows if isinstance(r, dict) and r.get("question")]
    return qs


def memory_mb() -> dict[str, float]:
    """This process's resident memory: anonymous (what it allocated) and file-backed (pages of memory-mapped
    files it touched: the page cache, which the kernel reclaims under pressure), from /proc/self/status."""
    rows = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    kb = {k: float(rows[k].split()[0]) for k in ("RssAnon", "RssFile", "RssShmem")}
    return {"anon": kb["RssAnon"] / 1024, "file": (kb["RssFile"] + kb["RssShmem"]) / 1024}


def _rss_mb() -> float:
    m = memory_mb()
    return m["anon"] + m["file"]


def build(engine: str, store: Path, index: Path) -> dict:
    from searchrl.data.docstore import DocStore
    from searchrl.envs.retrievers import RETRIEVERS

    name, args, _ = ENGINES[engine]
    t = time.perf_counter()
    r = RETRIEVERS.get(name)(DocStore(store), **args)
    r.save(index)
    build_s = time.perf_counter() - t
    disk = sum(f.stat().st_size for f in index.rglob("*") if f.is_file() and f.name != "docs.arrow")
    return {"build_s": build_s, "index_mb": disk / 2**20, "rss_build_mb": _rss_mb()}


def serve(engine: str, index: Path, queries: list[str], k: int = 5) -> dict:
    from searchrl.envs.retrievers import build_retriever

    name, _, args = ENGINES[engine]
    base = _rss_mb()
    t = time.perf_counter()
    r = build_retriever(name, index=index, **args)
    load_s = time.perf_counter() - t
    r.search(queries[:BATCH], k)  # warm-up (numba compiles here)
    t = time.perf_counter()
    top: list[list[str]] = []
    for i in range(0, len(queries), BATCH):
        top += [[d.id for d in row] for row in r.search(queries[i : i + BATCH], k)]
    secs = time.perf_counter() - t
    return {
        "load_s": load_s,
        "queries_per_s": len(queries) / secs,
        "rss_baseline_mb": base,
        "rss_serving_mb": _rss_mb(),
        "rss_anon_mb": memory_mb()["anon"],
        "top": top,
    }


def _child(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "_child", *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--kinds", nargs="+", default=["random", "natural"], choices=["random", "natural"])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--shared-data", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("runs/bm25_engines"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bm25_engines.json")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in a.sizes:
        for kind in a.kinds:
            store = a.work / f"{kind}-{size}.arrow"
            queries = make_corpus(kind, size, a.shared_data, store)
            qfile = store.with_suffix(".queries.json")
            tops: dict[str, list[list[str]]] = {}
            built: dict[str, dict] = {}
            for engine in a.engines:
                index = a.work / f"{kind}-{size}-{index_name(engine)}"
                record = (
                    index.parent / f"{index.name}.build.json"
                )  # an index built by an earlier run is reused
                if str(index) not in built:
                    if not record.exists():
                        record.write_text(json.dumps(_child(["build", engine, str(store), str(index)])))
                    built[str(index)] = json.loads(record.read_text())
                b = built[str(index)]
                s = _child(["serve", engine, str(index), str(qfile)])
                top = tops[engine] = s.pop("top")
                ref = REFERENCE.get(engine, "bm25s-numpy-1t")
                exact = tops.get(ref)
                agree = (
                    sum(len(set(x) & set(y)) for x, y in zip(top, exact)) / max(1, sum(len(y) for y in exact))
                    if exact is not None
                    else None
                )
                row = {"size": size, "corpus": kind, "engine": engine, "queries": len(queries), **b, **s}
                row |= {"top5_agreement": agree, "reference": ref}
                rows.append(row)
                print(json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": "2 CPU cores", "batch": BATCH, "k": 5, "rows": rows}, indent=1))
    print(
        "\n| passages | corpus | engine | build s | index MB | load s | RSS MB (anonymous) | queries/s "
        "| top-5 agreement (reference) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ag = "" if r["top5_agreement"] is None else f"{r['top5_agreement']:.2f} ({r['reference']})"
        print(
            f"| {r['size']:,} | {r['corpus']} | {r['engine']} | {r['build_s']:.1f} | {r['index_mb']:.0f} | "
            f"{r['load_s']:.2f} | {r['rss_serving_mb']:.0f} ({r['rss_anon_mb']:.0f}) | {r['queries_per_s']:.0f} | {ag} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        what = sys.argv[2]
        if what == "build":
            res = build(sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
        else:
            res = serve(sys.argv[3], Path(sys.argv[4]), json.loads(Path(sys.argv[5]).read_text()))
        print(json.dumps(res))
    else:
        main()
