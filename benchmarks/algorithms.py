"""GRPO vs PPO vs StePPO (StepSearch Table 2 / §4.2) on the synthetic world, from one SFT checkpoint, with the
same rollout budget per step (16 questions x 8 episodes) and steps, over several RL seeds.

    python benchmarks/algorithms.py --sft runs/quickstart/sft/final --seeds 0 1 2 [KEY=VALUE ...]

Each (algorithm, seed) is a `searchrl train experiments/synthetic/<algo>.yaml` run in
runs/algos-<algo>-seed<S>/ with `warm_start.checkpoint` pointing at the shared SFT model. Reports test EM,
F1, searches per question and the redundant-search rate (searches whose documents were all seen before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS = ("em", "f1", "searches_per_question", "redundant_search_rate")
TRAIN = ("rollout/tokens_generated", "time/step_s")  # summed over the run's steps


def _questions_per_step(run: str) -> int:
    import yaml

    cfg = yaml.safe_load((Path("runs") / run / "config.yaml").read_text())
    return int(cfg["trainer"]["batch_size"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", required=True, help="the SFT model every algorithm starts from")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "ppo", "steppo"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--name", default="algorithms", help="results file name; also tags the run directories")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results: dict[str, dict[int, dict[str, float]]] = {}
    sft: dict[str, float] = {}
    for algo in args.algorithms:
        config = REPO / "experiments" / "synthetic" / f"{algo}.yaml"
        results[algo] = {}
        for s in args.seeds:
            tag = "" if args.name == "algorithms" else f"-{args.name}"
            name = f"algos{tag}-{algo}-seed{s}"
            res_file = Path("runs") / name / "results.json"
            if not res_file.exists():
                cmd = [
                    sys.executable,
                    "-m",
                    "searchrl",
                    "train",
                    str(config),
                    f"name={name}",
                    f"seed={s}",
                    f"warm_start.checkpoint={Path(args.sft).resolve()}",
                    *args.overrides,
                ]
                print("$", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            res = json.loads(res_file.read_text())
            stage = next(k for k in res if k not in ("untrained", "sft"))
            results[algo][s] = {m: res[stage][m] for m in METRICS}
            rows = [
                json.loads(line) for line in (Path("runs") / name / "metrics.jsonl").read_text().splitlines()
            ]
            for m in TRAIN:
                results[algo][s][m] = sum(r.get(m, 0.0) for r in rows)
            questions = len(rows) * _questions_per_step(
                name
            )  # every step draws batch_size training questions
            results[algo][s]["generated_tokens_per_question"] = (
                results[algo][s]["rollout/tokens_generated"] / questions
            )
            sft = {m: res["sft"][m] for m in METRICS}
    cols = (*METRICS, "generated_tokens_per_question", "time/step_s")
    head = " | ".join(cols)
    print(f"\nFrom one SFT checkpoint ({args.sft}); mean ± std over seeds {args.seeds}\n")
    print(f"| run | {head} |\n|---" + "|---" * len(cols) + "|")
    print("| SFT start | " + " | ".join(f"{sft[m]:.3f}" for m in METRICS) + " | | |")
    summary = {}
    for algo, per_seed in results.items():
        cells, summary[algo] = [], {}
        for m in cols:
            vals = [per_seed[s][m] for s in args.seeds]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            summary[algo][m] = {"mean": statistics.mean(vals), "std": sd, "per_seed": vals}
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f}")
        print(f"| {algo} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps(
            {"sft": sft, "summary": summary, "seeds": args.seeds, "overrides": args.overrides}, indent=1
        )
    )


if __name__ == "__main__":
    main()
