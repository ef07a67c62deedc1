"""Learning benchmark: test EM of the untrained model, after the SFT warm start and after the main algorithm,
over several seeds (mean ± std), from an experiment file (the quickstart by default).

    python benchmarks/learning.py --seeds 0 1 2 [KEY=VALUE ...]

Each seed is a full `searchrl train` run in runs/learning-seed<S>/ (finished stages are reused on re-run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--name", default="learning")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    per_seed = {}
    for s in args.seeds:
        name = f"{args.name}-seed{s}"
        cmd = [
            sys.executable,
            "-m",
            "searchrl",
            "train",
            args.config,
            f"name={name}",
            f"seed={s}",
            *args.overrides,
        ]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        per_seed[s] = json.loads((Path("runs") / name / "results.json").read_text())
    first = next(iter(per_seed.values()))
    stages = [s for s in ("untrained", "sft") if s in first] + [
        s for s in first if s not in ("untrained", "sft")
    ]
    print(f"\n| stage | EM mean ± std over seeds {args.seeds} | per seed |\n|---|---|---|")
    summary = {}
    for st in stages:
        ems = [per_seed[s][st]["em"] for s in args.seeds]
        sd = statistics.stdev(ems) if len(ems) > 1 else 0.0
        summary[st] = {"mean": statistics.mean(ems), "std": sd, "per_seed": ems}
        print(f"| {st} | {statistics.mean(ems):.3f} ± {sd:.3f} | {', '.join(f'{e:.3f}' for e in ems)} |")
    if len(stages) >= 2:
        a, b = stages[-2], stages[-1]
        wins = sum(per_seed[s][b]["em"] > per_seed[s][a]["em"] for s in args.seeds)
        print(f"\n{b} beats {a} in {wins}/{len(args.seeds)} seeds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"per_seed": per_seed, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
