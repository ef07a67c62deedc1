"""Where the continuous batch's time goes: the per-episode loop (`rollout.agent_loop`) on the HF backend,
split into decode forwards, prefill forwards (prompts and appended observations), the rest of admitting
requests (the KV cache's bookkeeping), sampling, the environment and everything else, against our own plain
decode (`rollout_overhead.own_plain`: the same rows, no environment, no stops) of as many tokens per row.

    python benchmarks/stream_breakdown.py --model runs/quickstart/sft/final --questions 64 --group 8 \\
        --out benchmarks/results/stream_breakdown.json

``--questions 64`` with ``rollout.batch_size`` 128 keeps the batch full for most of the run (512 episodes
through 128 rows), as an asynchronous worker's is when it runs steps ahead; 16 is one synchronous step's
episodes. Each timing is a method's wall time inside the loop (nested calls are counted in their caller
too: "admit" includes its prefill forward). Torch runs ``--threads`` threads (1: one core).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(owner: Any, name: str, key: str, totals: dict[str, float], calls: collections.Counter) -> None:
    """Wrap ``owner.name`` so that its wall time adds to ``totals[key]``."""
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[key] += time.perf_counter() - t
            calls[key] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the quickstart's SFT model")
    ap.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "stream_breakdown.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rollout_overhead import own_plain

    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.models.policy import load_policy
    from searchrl.rollout import agent_loop, continuous, decoding
    from searchrl.rollout.generator import GENERATORS, SamplingParams
    from searchrl.rollout.loop import encode, rollout

    exp = load_experiment(args.config, [f"model.path={args.model}"])
    resources = Resources(exp)
    env = resources.env()
    policy, tok = load_policy(args.model, exp.model.dtype, None, False, False)
    policy.eval()
    gen = GENERATORS.get("hf")(
        policy, tok, env.stop_strings, batch_size=exp.rollout.batch_size, continuous=True
    )
    examples = resources.examples("train")[: args.questions]
    params = SamplingParams(exp.rollout.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens)
    rollout(examples[:2], env, gen, tok, params, 2, exp.rollout.max_total_tokens)  # warm-up

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timed(continuous.HFStream, "_admit", "admit (prefill forward + cache bookkeeping)", totals, calls)
    timed(decoding, "sample", "sampling", totals, calls)
    timed(agent_loop, "step_env", "environment step", totals, calls)
    model_call = type(policy).__call__

    def call(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return model_call(self, *a, **k)
        finally:
            ids = k.get("input_ids")
            key = "decode forward" if ids is not None and ids.shape[1] == 1 else "prefill forward"
            totals[key] += time.perf_counter() - t
            calls[key] += 1

    type(policy).__call__ = call  # type: ignore[method-assign]
    runs = []
    for r in range(args.repeats):
        totals.clear()
        calls.clear()
        torch.manual_seed(r)
        t = time.perf_counter()
        trajs, stats = rollout(examples, env, gen, tok, params, args.group, exp.rollout.max_total_tokens)
        wall = time.perf_counter() - t
        runs.append(
            {
                "seconds": wall,
                "tokens_generated": stats.tokens_generated,
                "tokens_per_s": stats.tokens_generated / wall,
                "context_tokens_mean": statistics.mean(len(x) for x in trajs),
                "split_s": dict(totals),
                "calls": dict(calls),
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    type(policy).__call__ = model_call  # type: ignore[method-assign]
    n = max(1, round(statistics.mean(x["tokens_generated"] for x in runs) / (len(examples) * args.group)))
    prompts = [
        encode(tok, env.reset(ex).prompt) for ex in resources.examples("train")[: exp.rollout.batch_size]
    ]
    own_plain(policy, tok, prompts, 4, exp.rollout.temperature)  # warm-up
    plain = statistics.median(
        len(prompts) * n / own_plain(policy, tok, prompts, n, exp.rollout.temperature) for _ in range(3)
    )
    best = min(runs, key=lambda x: x["seconds"])
    out = {
        "model": args.model,
        "questions": args.questions,
        "group": args.group,
        "batch_size": exp.rollout.batch_size,
        "threads": args.threads,
        "cpu": os.cpu_count(),
        "runs": runs,
        "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in runs),
        "plain_decode_tokens_per_s": plain,
        "plain_decode_rows": len(prompts),
        "plain_decode_tokens_each": n,
        "loop_vs_plain": statistics.median(x["tokens_per_s"] for x in runs) / plain,
        "share_of_fastest_run": {k: v / best["seconds"] for k, v in best["split_s"].items()},
    }
    print(
        json.dumps({k: out[k] for k in ("tokens_per_s_median", "plain_decode_tokens_per_s", "loop_vs_plain")})
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
