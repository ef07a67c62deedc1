"""Peak memory of each algorithm on the family bench's setting: each ``experiments/synthetic/<algo>.yaml``
trained ``--steps`` steps from one SFT checkpoint (the bench's start) in its own process, its peak resident
memory read from ``metrics.jsonl`` (``mem/peak_rss_gb``, the process's largest since it started: model
loading, the start's evaluation and the training steps; on CUDA also ``mem/peak_gpu_gb``), beside its
seconds and generated tokens per step. Evaluation is cut to ``--eval-limit`` questions: the figure is the
training's, not a full test pass's. Writes benchmarks/results/<name>.{json,md}.

    python benchmarks/peak_memory.py --sft runs/quickstart/sft/final --algorithms grpo ppo slate --steps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", required=True, help="the SFT model every algorithm starts from")
    p.add_argument("--algorithms", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval-limit", type=int, default=16)
    p.add_argument("--name", default="peak_memory")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    rows: dict[str, dict[str, float]] = {}
    for algo in args.algorithms:
        run = Path("runs") / f"{args.name}-{algo}"
        metrics = run / "metrics.jsonl"
        if not metrics.exists():
            cmd = [
                sys.executable,
                "-m",
                "searchrl",
                "train",
                str(REPO / "experiments" / "synthetic" / f"{algo}.yaml"),
                f"output_dir={run}",
                f"warm_start.checkpoint={Path(args.sft).resolve()}",
                f"trainer.steps={args.steps}",
                f"trainer.eval_every={args.steps + 1}",
                f"trainer.save_every={args.steps + 1}",
                f"eval.limit={args.eval_limit}",
                "trainer.samples.groups=0",
                *args.overrides,
            ]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        steps = [json.loads(line) for line in metrics.read_text().splitlines()]
        steps = [r for r in steps if "mem/peak_rss_gb" in r]
        if not steps:
            raise SystemExit(f"{metrics}: no mem/peak_rss_gb (a run from before the metric was logged)")
        rows[algo] = {
            "peak_rss_gb": max(r["mem/peak_rss_gb"] for r in steps),
            "step_s": statistics.mean(r["time/step_s"] for r in steps),
            "tokens_generated_per_step": statistics.mean(
                r.get("rollout/tokens_generated", 0.0) for r in steps
            ),
        }
        gpu = [r["mem/peak_gpu_gb"] for r in steps if "mem/peak_gpu_gb" in r]
        if gpu:
            rows[algo]["peak_gpu_gb"] = max(gpu)
    table = [
        f"Peak memory, {args.steps} training steps from {args.sft}, evaluation cut to {args.eval_limit} questions",
        "",
        "| algorithm | peak RSS GB | s per step | generated tokens per step |",
        "|---|---|---|---|",
        *(
            f"| {a} | {r['peak_rss_gb']:.2f} | {r['step_s']:.1f} | {r['tokens_generated_per_step']:.0f} |"
            for a, r in rows.items()
        ),
    ]
    print("\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text("\n".join(table) + "\n")
    record = {
        "what": table[0],
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "overrides": args.overrides,
        "algorithms": rows,
    }
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
