"""The controlled study's question (arXiv 2605.27881) on the quickstart world: does the retrieval corpus's coverage
matter more than the choice of algorithm?

    python benchmarks/coverage.py --full bench_2026_turn_credit_seeds12 --reduced coverage_2026_c08 \
        --coverage 0.8 --algorithms grpo gigpo igpo tree_grpo --seeds 0 1 2

reads the run directories `benchmarks/algorithms.py` wrote for the two names (runs/algos-NAME-ALGO-seedS/: the
same SFT checkpoint, the same RL seeds and steps, the corpus whole or with ``data.world.coverage`` of its entity
documents kept; the questions are the same, so the comparison is paired), and writes
benchmarks/results/coverage_2026.{md,json}: test EM per algorithm × coverage (mean ± std over seeds), EM split by
whether every gold document of the question is still in the reduced corpus, the effect of coverage per algorithm
and of every two algorithms at each coverage (paired bootstrap over questions × seeds), and the two-way summary:
the mean coverage effect against the largest difference between algorithms.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
from datetime import date
from pathlib import Path

RUNS = Path("runs")


def run_dir(name: str, algo: str, seed: int) -> Path:
    return RUNS / f"algos-{name}-{algo}-seed{seed}"


def predictions(run: Path, stage: str) -> dict[str, dict]:
    """A run's per-question test predictions: the SFT start's (``sft``), or else its RL stage's (named for the
    algorithm class: GiGPO's and IGPO's stage is ``grpo``)."""
    if stage != "sft":
        [path] = [
            p
            for p in (run / "eval").glob("*-test.predictions.jsonl")
            if p.name.split("-")[0] not in ("sft", "untrained")
        ]
    else:
        path = run / "eval" / "sft-test.predictions.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def corpus_ids(run: Path) -> set[str]:
    return {json.loads(line)["id"] for line in (run / "world" / "corpus.jsonl").read_text().splitlines()}


def main() -> None:
    from searchrl.core.stats import paired_bootstrap

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", required=True, help="the bench name whose runs used the whole corpus")
    p.add_argument("--reduced", required=True, help="the bench name whose runs used the reduced corpus")
    p.add_argument("--coverage", type=float, required=True, help="the reduced runs' data.world.coverage")
    p.add_argument("--algorithms", nargs="+", required=True)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    arms = {"full": args.full, "reduced": args.reduced}
    cov = {"full": 1.0, "reduced": args.coverage}
    kept = corpus_ids(run_dir(args.reduced, args.algorithms[0], args.seeds[0]))
    first = predictions(run_dir(args.full, args.algorithms[0], args.seeds[0]), args.algorithms[0])
    ids = sorted(first)
    answerable = {q for q in ids if set(first[q]["gold_doc_ids"]) <= kept}

    # scores[(arm, algo)][seed][question] = EM; the SFT start evaluated in every run of an arm
    scores: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for arm, name in arms.items():
        for algo in ["sft", *args.algorithms]:
            runs = {s: run_dir(name, args.algorithms[0] if algo == "sft" else algo, s) for s in args.seeds}
            scores[(arm, algo)] = {
                s: {q: r["em"] for q, r in predictions(d, algo).items()} for s, d in runs.items()
            }

    def per_seed(arm: str, algo: str, subset: set[str] | None = None) -> list[float]:
        out = []
        for s in args.seeds:
            qs = [q for q in ids if subset is None or q in subset]
            out.append(sum(scores[(arm, algo)][s][q] for q in qs) / len(qs))
        return out

    def matrix(arm: str, algo: str) -> list[list[float]]:
        return [[scores[(arm, algo)][s][q] for q in ids] for s in args.seeds]

    def fmt(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

    algos = ["sft", *args.algorithms]
    table = {
        algo: {
            arm: {
                "em": per_seed(arm, algo),
                "em_answerable": per_seed(arm, algo, answerable),
                "em_unanswerable": per_seed(arm, algo, set(ids) - answerable),
            }
            for arm in arms
        }
        for algo in algos
    }
    coverage_effect = {}
    for algo in algos:
        t = paired_bootstrap(matrix("full", algo), matrix("reduced", algo))
        coverage_effect[algo] = {
            "difference": t.difference.mean,
            "low": t.difference.low,
            "high": t.difference.high,
            "p": t.p_value,
        }
    algorithm_pairs = []
    for arm in arms:
        for i, a in enumerate(args.algorithms):
            for b in args.algorithms[i + 1 :]:
                t = paired_bootstrap(matrix(arm, a), matrix(arm, b))
                algorithm_pairs.append(
                    {
                        "coverage": cov[arm],
                        "a": a,
                        "b": b,
                        "difference": t.difference.mean,
                        "low": t.difference.low,
                        "high": t.difference.high,
                        "p": t.p_value,
                    }
                )
    mean_em = {arm: {a: statistics.mean(table[a][arm]["em"]) for a in args.algorithms} for arm in arms}
    mean_cov_effect = statistics.mean(coverage_effect[a]["difference"] for a in args.algorithms)
    spread = {cov[arm]: max(mean_em[arm].values()) - min(mean_em[arm].values()) for arm in arms}
    summary = {
        "mean_coverage_effect_rl": mean_cov_effect,
        "coverage_effect_sft": coverage_effect["sft"]["difference"],
        "algorithm_spread_at_coverage": spread,
        "coverage_over_algorithm": mean_cov_effect / max(max(spread.values()), 1e-9),
        "answerable_share": len(answerable) / len(ids),
    }

    lines = [
        f"# Corpus coverage × algorithm on the quickstart world ({date.today().isoformat()})",
        "",
        f"Test EM (greedy, {len(ids)} questions), mean ± std over seeds {args.seeds}; corpus whole (1.0) or "
        f"with {args.coverage:.0%} of its entity documents kept ({len(answerable)} of {len(ids)} test questions "
        "keep every gold document). Same SFT checkpoint, RL seeds, steps and questions in both arms.",
        "",
        "| arm | EM, coverage 1.0 | EM, coverage "
        f"{args.coverage} | coverage effect [95% CI] | p | gold-kept questions, 1.0 → {args.coverage} | gold missing, "
        f"1.0 → {args.coverage} |",
        "|---|---|---|---|---|---|---|",
    ]
    for algo in algos:
        e, row = coverage_effect[algo], table[algo]
        lines.append(
            f"| {'SFT start' if algo == 'sft' else algo} | {fmt(row['full']['em'])} | {fmt(row['reduced']['em'])} | "
            f"{e['difference']:+.3f} [{e['low']:+.3f}, {e['high']:+.3f}] | {e['p']:.4f} | "
            f"{fmt(row['full']['em_answerable'])} → {fmt(row['reduced']['em_answerable'])} | "
            f"{fmt(row['full']['em_unanswerable'])} → {fmt(row['reduced']['em_unanswerable'])} |"
        )
    lines += [
        "",
        "Algorithms against each other at each coverage (paired bootstrap over questions × seeds):",
        "",
        "| coverage | a | b | EM a − b [95% CI] | p |",
        "|---|---|---|---|---|",
    ]
    for r in algorithm_pairs:
        lines.append(
            f"| {r['coverage']} | {r['a']} | {r['b']} | {r['difference']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] "
            f"| {r['p']:.4f} |"
        )
    lines += [
        "",
        f"Mean coverage effect over the RL algorithms: {mean_cov_effect:+.3f} EM; the largest difference between "
        "algorithm means: "
        + ", ".join(f"{v:.3f} at coverage {k}" for k, v in spread.items())
        + f"; ratio {summary['coverage_over_algorithm']:.1f}.",
    ]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = Path(args.out)
    (out / "coverage_2026.md").write_text("\n".join(lines) + "\n")
    (out / "coverage_2026.json").write_text(
        json.dumps(
            {
                "table": table,
                "coverage_effect": coverage_effect,
                "algorithm_pairs": algorithm_pairs,
                "summary": summary,
                "runs": {arm: f"runs/algos-{name}-ALGO-seedS" for arm, name in arms.items()},
                "coverage": args.coverage,
                "seeds": args.seeds,
                "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
                "date": date.today().isoformat(),
                "commit": commit,
                "command": "python benchmarks/coverage.py "
                + " ".join(
                    [
                        f"--full {args.full} --reduced {args.reduced} --coverage {args.coverage}",
                        "--algorithms " + " ".join(args.algorithms),
                        "--seeds " + " ".join(map(str, args.seeds)),
                    ]
                ),
            },
            indent=1,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
