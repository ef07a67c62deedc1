"""Learning benchmark: test EM of the untrained model, after the SFT warm start and after the main algorithm,
over several seeds (mean ± std), from an experiment file (the quickstart by default).

    python benchmarks/learning.py --seeds 0 1 2 3 4 [KEY=VALUE ...]

Each seed is a full `searchrl train` run in runs/learning-seed<S>/ (a finished run is summarised, not run again;
an unfinished one resumes its finished stages).
From the per-question predictions it also gives each stage's 95% bootstrap interval over seeds and questions,
the paired test of the last stage against the one before (same questions, same seeds), each run's wall time,
and the quickstart's targets (issue 17): the RL stage beats its own SFT start by >= 0.05 in every seed and by
>= 0.10 on average, the SFT stage's std over seeds <= 0.05, and a run takes <= 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--name", default="learning")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--no-train", action="store_true", help="only summarise the runs already in runs/")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    per_seed, minutes = {}, {}
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
            "trainer.samples.groups=0",  # benchmarks write no training samples
            *args.overrides,
        ]
        run = Path("runs") / name
        if args.no_train or (run / "results.json").exists():
            # a finished run is summarised, not run again (which would evaluate it again and time only that);
            # its wall time from the run directory's first and last files
            minutes[s] = ((run / "results.json").stat().st_mtime - (run / "config.yaml").stat().st_mtime) / 60
        else:
            print("$", " ".join(cmd), flush=True)
            t = time.perf_counter()
            subprocess.run(cmd, check=True)
            minutes[s] = (time.perf_counter() - t) / 60
        per_seed[s] = json.loads((run / "results.json").read_text())
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
    checks: dict[str, object] = {}
    if len(stages) >= 2:
        a, b = stages[-2], stages[-1]
        gains = [per_seed[s][b]["em"] - per_seed[s][a]["em"] for s in args.seeds]
        print(f"\n{b} - {a} per seed: {', '.join(f'{g:+.3f}' for g in gains)}")
        summary["intervals"], summary["paired"] = statistics_of(args, stages, a, b)
        checks = {
            "gain_every_seed_ge_0.05": min(gains) >= 0.05,
            "mean_gain_ge_0.10": statistics.mean(gains) >= 0.10,
            "sft_std_le_0.05": summary.get("sft", {}).get("std", 0.0) <= 0.05,
            "minutes_le_15": max(minutes.values(), default=0.0) <= 15,
        }
        print("targets:", ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks.items()))
    if minutes:
        print("minutes per run:", ", ".join(f"seed {s}: {m:.1f}" for s, m in minutes.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps(
            {
                "per_seed": per_seed,
                "summary": summary,
                "minutes": minutes,
                "targets": checks,
                "args": vars(args),
            },
            indent=1,
        )
    )


def statistics_of(args: argparse.Namespace, stages: list[str], a: str, b: str) -> tuple[dict, dict]:
    """Each stage's two-level bootstrap interval, and the paired test of ``b`` against ``a``, from the
    per-question predictions."""
    from searchrl.app.eval_episodes import read_predictions
    from searchrl.core.stats import align, bootstrap_ci, paired_bootstrap

    def scores(stage: str) -> dict[int, dict[str, float]]:
        return {
            s: {
                r["id"]: float(r["em"])
                for r in read_predictions(
                    Path("runs") / f"{args.name}-seed{s}" / "eval" / f"{stage}-test.predictions.jsonl"
                )
            }
            for s in args.seeds
        }

    by_stage = {st: scores(st) for st in stages}
    intervals = {}
    for st in stages:
        iv = bootstrap_ci(align(by_stage[st], by_stage[st])[0])
        intervals[st] = {"mean": iv.mean, "low": iv.low, "high": iv.high}
        print(f"{st}: EM {iv} (95% CI over {iv.seeds} seeds x {iv.questions} questions)")
    test = paired_bootstrap(*align(by_stage[b], by_stage[a]))
    d = test.difference
    print(f"{b} - {a}: {d} paired, p = {test.p_value:.4f}")
    return intervals, {"difference": d.mean, "low": d.low, "high": d.high, "p": test.p_value}


if __name__ == "__main__":
    main()
