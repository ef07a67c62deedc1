"""Sampler-trainer mismatch per backend and staleness: GRPO from one SFT model for a few steps in each arm,
and per arm the mean over steps of what the trainer logs about the log-probs it trains on.

    python benchmarks/mismatch.py --sft runs/quickstart/sft/final --steps 10 \
        --arms hf-sync vllm-sync vllm-async1 vllm-async4 [KEY=VALUE ...]

Arms: ``<backend>-sync`` (synchronous, on-policy: only the kernels differ) and ``<backend>-async<k>``
(``trainer.async_rollout.max_staleness: k``, with the worker on that backend); every arm logs the
correction's diagnostics with ``algorithm.rollout_correction: {mode: token_tis}`` (truncated at 2). The
vLLM arms need vLLM (on a CPU machine the CPU build in its own environment: `.ci/vllm` makes one), so run
the whole benchmark from that environment. Each arm is a `searchrl train` run in runs/mismatch-<arm>/
(reused if finished). Writes benchmarks/results/NAME.json and prints a table. The figures are from one
seed: k3 KL of ~1e-6 or less is rounding, not a difference between backends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = (
    "rollout/logprob_abs_diff",
    "rollout/logprob_max_diff",
    "rollout_corr/k3_kl",
    "rollout_corr/cut_token_frac",
    "rollout_corr/cut_seq_frac",
    "rollout_corr/ess",
    "async/fresh_token_frac",
    "async/logprob_abs_diff_fresh",
    "async/logprob_abs_diff_stale",
    "async/staleness_mean",
    "time/step_s",
)


def overrides_of(arm: str) -> list[str]:
    backend, _, mode = arm.partition("-")
    if backend not in ("hf", "vllm") or not (mode == "sync" or mode.startswith("async")):
        raise SystemExit(f"arm {arm!r}: expected hf-sync, vllm-sync, hf-async<k> or vllm-async<k>")
    over = [f"rollout.backend={backend}"]
    if backend == "vllm":  # float32 as the trainer, so that only the kernels differ
        over.append("rollout.backend_args={gpu_memory_utilization: 0.3, dtype: float32}")
    if mode != "sync":
        over.append(f"trainer.async_rollout.max_staleness={int(mode.removeprefix('async'))}")
    return over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--sft", required=True, help="the SFT model every arm starts from")
    p.add_argument("--arms", nargs="+", default=["hf-sync", "vllm-sync", "vllm-async1", "vllm-async4"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="mismatch")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    table: dict[str, dict[str, float]] = {}
    for arm in args.arms:
        run = Path("runs") / f"{args.name}-{arm}"
        if not (run / "results.json").exists():
            cmd = [
                sys.executable,
                "-m",
                "searchrl",
                "train",
                args.config,
                f"name={run.name}",
                f"seed={args.seed}",
                f"warm_start.checkpoint={Path(args.sft).resolve()}",
                f"trainer.steps={args.steps}",
                f"trainer.save_every={args.steps}",
                "trainer.eval_every=0",
                "trainer.samples.groups=0",
                "eval.limit=20",
                "algorithm.rollout_correction={mode: token_tis}",
                *overrides_of(arm),
                *args.overrides,
            ]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        table[arm] = {
            k: statistics.mean(r[k] for r in rows if k in r) for k in KEYS if any(k in r for r in rows)
        }
    cols = [k for k in KEYS if any(k in t for t in table.values())]
    print("\n| arm | " + " | ".join(cols) + " |\n|---" + "|---" * len(cols) + "|")
    for arm, t in table.items():
        print(f"| {arm} | " + " | ".join(f"{t[k]:.3g}" if k in t else "" for k in cols) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps(
            {
                "arms": table,
                "steps": args.steps,
                "seed": args.seed,
                "sft": args.sft,
                "overrides": args.overrides,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
