"""Retrieval benchmark: recall@1/3/5 of the gold supporting document, and queries/s, for BM25, dense, hybrid.

    python benchmarks/retrieval.py --data ../shared/data/musique/hipporag_musique_train_100.json \
        --corpus ../shared/data/musique/hipporag_musique_train_100_corpus.json
    python benchmarks/retrieval.py --synthetic --seed 0

For each question: every decomposition sub-question (and, on the synthetic world, every gold search key) is
a query whose target is that hop's gold document; the full question's target is any of its gold documents.
Results are printed as a table and written to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from searchrl.data import load_corpus, load_examples
from searchrl.envs.retrievers import build_retriever

KS = (1, 3, 5)


def recall(retriever, queries: list[str], golds: list[set[str]]) -> dict[str, float]:
    t = time.perf_counter()
    results = retriever.search(queries, max(KS))
    dt = time.perf_counter() - t
    out = {
        f"R@{k}": sum(bool(g & {d.id for d in r[:k]}) for g, r in zip(golds, results)) / len(queries)
        for k in KS
    }
    out["queries/s"] = len(queries) / dt
    out["n"] = len(queries)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data")
    p.add_argument("--corpus")
    p.add_argument("--synthetic", action="store_true", help="use a generated synthetic world (test split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retrievers", default="bm25,dense,hybrid")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()

    if args.synthetic:
        from searchrl.envs.synthetic.world import World, WorldConfig

        world = World.generate(WorldConfig(seed=args.seed))
        corpus, examples, name = world.documents(), world.examples("test"), f"synthetic-seed{args.seed}"
    else:
        if not (args.data and args.corpus):
            p.error("pass --data and --corpus, or --synthetic")
        corpus = load_corpus(args.corpus)
        examples, name = load_examples(args.data, corpus=corpus), Path(args.data).stem

    sets = {
        "sub-question": [(h.question, {h.gold_doc_id}) for e in examples for h in e.hops if h.gold_doc_id],
        "full question": [(e.question, set(e.gold_doc_ids)) for e in examples if e.gold_doc_ids],
    }
    if args.synthetic:
        sets["gold key"] = [(k, {h.gold_doc_id}) for e in examples for h in e.hops for k in h.keys]
    rows = {}
    for rname in args.retrievers.split(","):
        kwargs = {"retrievers": [{"name": "bm25"}, {"name": "dense"}]} if rname == "hybrid" else {}
        t = time.perf_counter()
        retriever = build_retriever(rname, corpus=corpus, **kwargs)
        build_s = time.perf_counter() - t
        for set_name, pairs in sets.items():
            r = recall(retriever, [q for q, _ in pairs], [g for _, g in pairs])
            rows[f"{rname} / {set_name}"] = {**r, "index_build_s": build_s}
    print(f"\n{name}: {len(corpus)} documents, {len(examples)} questions\n")
    print("| retriever / queries | n | R@1 | R@3 | R@5 | queries/s |\n|---|---|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['n']} | {r['R@1']:.3f} | {r['R@3']:.3f} | {r['R@5']:.3f} | {r['queries/s']:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"retrieval-{name}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
