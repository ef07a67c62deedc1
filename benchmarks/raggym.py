"""RAG-Gym process supervision (Table 2's comparison) on the synthetic world: for each agent design and seed,
from one base policy, collect process data, then train SFT, DPO and a PRM on it and evaluate on the test split.

    python benchmarks/raggym.py --base runs/quickstart/sft/final --designs react research --seeds 0 1 2

Per (design, seed), in runs/raggym-bench-<design>-seed<S>-*:

1. ``searchrl collect-process-data experiments/synthetic/raggym[_research]_sft.yaml`` (seed S);
2. ``searchrl train`` of the design's raggym_{sft,dpo,prm}.yaml on that data (seed S), each of which evaluates
   its result: SFT, DPO, DPO with the chosen actions' NLL added (``rpo_alpha`` 1), and the PRM, evaluated
   as PRM-guided best-of-N for N in 1, 4, 8 (N = 1 is plain sampling at the same temperature: the baseline
   the PRM's choice is measured against).

Reports test EM / F1 (mean ± std over seeds) of the base policy (greedy), RAG-Gym SFT, DPO, and PRM best-of-N,
and the data counts, to benchmarks/results/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"react": "raggym", "research": "raggym_research"}
# run suffix -> (experiment file suffix, extra overrides, label of its trained stage)
VARIANTS = {
    "sft": ("sft", [], "RAG-Gym SFT"),
    "dpo": ("dpo", [], "DPO (eq. 6)"),
    "dpo-rpo": (
        "dpo",
        ["algorithm={name: dpo, beta: 0.1, rpo_alpha: 1.0}"],
        "DPO + chosen-NLL (rpo_alpha 1)",
    ),
    "prm": ("prm", ["eval.best_of=[1, 4, 8]"], None),  # stages "prm best-of-N"
}


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def stage_metrics(run_dir: Path) -> dict[str, dict[str, float]]:
    return {
        k: {"em": v["em"], "f1": v["f1"]}
        for k, v in json.loads((run_dir / "results.json").read_text()).items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the base policy every design starts from (an SFT model)")
    p.add_argument("--designs", nargs="+", default=["react", "research"], choices=sorted(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--questions", type=int, default=300, help="training questions for process data")
    p.add_argument("--name", default="raggym", help="results file name; also tags the run directories")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of best-of-N's candidates"
    )
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every training run")
    args = p.parse_args()
    base = str(Path(args.base).resolve())
    sx = [sys.executable, "-m", "searchrl"]
    rows: dict[str, dict[str, list[float]]] = {}
    data_counts: dict[str, list[dict[str, float]]] = {}
    for design in args.designs:
        cfg = REPO / "experiments" / "synthetic"
        for s in args.seeds:
            tag = f"runs/{args.name}-bench-{design}-seed{s}"
            data = f"{tag}-data"
            common = [f"seed={s}", f"process_data.out={data}", f"process_data.limit={args.questions}"]
            if not (Path(data) / "summary.json").exists():
                run(
                    [
                        *sx,
                        "collect-process-data",
                        str(cfg / f"{CONFIGS[design]}_sft.yaml"),
                        "--model",
                        base,
                        *common,
                    ]
                )
            summary = json.loads((Path(data) / "summary.json").read_text())
            data_counts.setdefault(design, []).append(
                {k: summary[k] for k in ("questions", "kept_episodes", "steps", "pairs")}
            )
            for variant, (algo, extra, trained) in VARIANTS.items():
                out = Path(f"{tag}-{variant}")
                if not (out / "results.json").exists():
                    run(
                        [
                            *sx,
                            "train",
                            str(cfg / f"{CONFIGS[design]}_{algo}.yaml"),
                            f"name={out.name}",
                            f"warm_start.checkpoint={base}",
                            f"eval.best_of_temperature={args.temperature}",
                            "trainer.samples.groups=0",  # benchmarks write no training samples
                            *common,
                            *extra,
                            *args.overrides,
                        ]
                    )
                for stage, m in stage_metrics(out).items():
                    if stage == "untrained" or (stage == "sft" and variant != "sft"):
                        continue  # the base policy ("sft": the warm start) is reported once
                    label = "base policy (greedy)" if stage == "sft" else (trained or stage)
                    for k, v in m.items():
                        rows.setdefault(f"{design} | {label}", {}).setdefault(k, []).append(v)

    def cell(vals: list[float]) -> str:
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.mean(vals):.3f} ± {sd:.3f}"

    lines = [
        f"From one base policy ({args.base}); test split; mean ± std over seeds {args.seeds}; "
        f"process data from {args.questions} training questions per seed; best-of-N candidates sampled at "
        f"temperature {args.temperature}.",
        "",
        "| design | method | EM | F1 |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {cell(v['em'])} | {cell(v['f1'])} |" for k, v in rows.items()]
    lines += ["", "| design | kept episodes | annotated steps | pairs |", "|---|---|---|---|"]
    for design, counts in data_counts.items():
        lines.append(
            f"| {design} | "
            + " | ".join(cell([c[k] for c in counts]) for k in ("kept_episodes", "steps", "pairs"))
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(
        json.dumps({"rows": rows, "data": data_counts, "seeds": args.seeds}, indent=1)
    )


if __name__ == "__main__":
    main()
