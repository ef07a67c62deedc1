"""GRPO steps, synchronous against asynchronous rollouts (``trainer.async_rollout.max_staleness`` 1 and 4),
with the quickstart's retriever as is and with 50 ms added to every retrieval call (a remote server).

    python benchmarks/async_rollout.py --model runs/quickstart/sft/final --steps 6 --out benchmarks/results/async.json

Each asynchronous setting runs with the worker as a thread of the trainer's process and as a process of its own
(``trainer.async_rollout.worker``; ``--worker``). Per setting: seconds per step and generated tokens per second end to end (the first step, a warm-up, is not
counted), the trainer's wait for episodes, and the rollout worker's own generated tokens per second of its busy
time (decode and environment), against our own plain decode (`rollout_overhead.own_plain`, no environment) of
the rollout batch's rows (``rollout.batch_size``) for as many tokens each as the synchronous run's episodes
generated on average. ``--pin``: torch single-threaded, the trainer's thread on core
0 and the rollout worker (its thread, or its process with one torch thread) on core 1 (Linux affinity is per
thread); the synchronous run then has one core.
Without it every setting shares the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from searchrl.algorithms import algorithm_config
from searchrl.app.experiment import load_experiment
from searchrl.app.resources import Resources
from searchrl.core.config import AsyncRolloutConfig, SamplesConfig, TrainerConfig
from searchrl.engine.trainer import Trainer
from searchrl.rollout import async_rollout

REPO = Path(__file__).resolve().parents[1]


class SlowRuntime(Resources):
    """The experiment's resources with ``latency`` seconds added to every retrieval call (a remote server's),
    in this process and in a rollout worker process, which builds its own from `fresh`."""

    def __init__(self, exp: Any, latency: float = 0.0) -> None:
        super().__init__(exp)
        self.latency, self._slowed = latency, False

    def fresh(self) -> SlowRuntime:
        return SlowRuntime(self.exp, self.latency)

    def env(self, chat_format: Any = None) -> Any:
        env = super().env(chat_format)  # every environment of a run shares the cached retriever
        if self.latency and not self._slowed:
            search, latency = self.retriever.search, self.latency

            def delayed(queries: Any, k: int) -> Any:
                time.sleep(latency)
                return search(queries, k)

            self.retriever.search = delayed  # type: ignore[method-assign]
            self._slowed = True
        return env


def run(
    exp: Any,
    model: str,
    steps: int,
    staleness: int,
    latency: float,
    group: int,
    questions: int,
    worker: str = "thread",
    pin: bool = False,
) -> dict:
    resources = SlowRuntime(exp, latency)
    cfg = TrainerConfig(
        steps=steps,
        batch_size=questions,
        micro_batch_size=32,
        lr=3e-4,
        save_every=10**9,
        log_entropy=False,
        samples=SamplesConfig(groups=0),  # a timing: no training samples written
        async_rollout=AsyncRolloutConfig(
            max_staleness=staleness,
            worker=worker,  # type: ignore[arg-type]
            worker_threads=1 if pin else None,
            worker_cpus=(1,) if pin else (),
        ),
    )
    tr = Trainer(
        algorithm="grpo",
        config=algorithm_config(
            "grpo", {"group_size": group, "kl_coef": 0.0, "rollout_correction": {"mode": "token_tis"}}
        ),
        model_path=model,
        cfg=cfg,
        out_dir=Path(tempfile.mkdtemp()),
        resources=resources,
        seed=0,
    )
    times, tokens, waits, stale, worker_rate, searches = [], [], [], [], [], []
    try:
        for s in range(steps):
            t = time.perf_counter()
            m = tr.step(s)
            times.append(time.perf_counter() - t)
            tokens.append(m["rollout/tokens_generated"])
            waits.append(m.get("async/wait_s", m["time/collect_s"]))
            stale.append(m.get("async/staleness_mean", 0.0))
            worker_rate.append(m.get("async/worker_tokens_per_s", 0.0))
            searches.append(m.get("rollout/searches_per_episode", 0.0))
    finally:
        if tr.rollouts.worker is not None:
            tr.rollouts.worker.close()
    t, n = times[1:], tokens[1:]
    return {
        "max_staleness": staleness,
        "worker": worker if staleness else None,
        "retrieval_latency_s": latency,
        "s_per_step": statistics.mean(t),
        "tokens_per_s": sum(n) / sum(t),
        "wait_for_episodes_s": statistics.mean(waits[1:]),
        "staleness_mean": statistics.mean(stale[1:]),
        # the worker's generated tokens per second of its own busy time (decode + environment), over the run
        "worker_tokens_per_s": worker_rate[-1] if staleness else None,
        "tokens_per_episode": sum(n) / (len(n) * questions * group),
        # retrieval calls per episode: the latency applies to these only (a random-weight model makes none)
        "searches_per_episode": statistics.mean(searches[1:]),
        "steps_timed": len(t),
    }


def plain_decode(model: str, exp: Any, rows: int, n: int, pin: bool) -> float:
    """Our own decode loop's tokens/s (`rollout_overhead.own_plain`: no environment, no stops) for ``rows``
    rows of ``n`` tokens from the training questions' prompts, on the worker's core when pinned."""
    from rollout_overhead import own_plain

    from searchrl.models import load_model_and_tokenizer
    from searchrl.rollout.loop import encode

    if pin:
        os.sched_setaffinity(0, {1})
    policy, tok = load_model_and_tokenizer(model, dtype=exp.model.dtype)
    policy.to("cuda" if torch.cuda.is_available() else "cpu")
    resources = Resources(exp)
    env = resources.env()
    prompts = [encode(tok, env.reset(ex).prompt) for ex in resources.examples("train")[:rows]]
    own_plain(policy, tok, prompts, 4, exp.rollout.temperature)  # warm-up
    s = own_plain(policy, tok, prompts, n, exp.rollout.temperature)
    return rows * n / s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the policy to start from (the quickstart's SFT model)")
    ap.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.05])
    ap.add_argument("--worker", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--dtype", default="float32", help="model.dtype (bfloat16 on a GPU)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async.json"))
    ap.add_argument(
        "overrides", nargs="*", help="config overrides KEY=VALUE, e.g. rollout.prefix_sharing=true"
    )
    args = ap.parse_args()
    if args.pin:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {0})  # this (the trainer's) thread
        start = async_rollout.AsyncRollout._run

        def pinned(self: Any) -> None:
            os.sched_setaffinity(0, {1})  # the worker's thread
            start(self)

        async_rollout.AsyncRollout._run = pinned  # type: ignore[method-assign]
    exp = load_experiment(
        args.config, [f"model.path={args.model}", f"model.dtype={args.dtype}", *args.overrides]
    )
    rows = []
    for latency in args.latency:
        for k in args.staleness:
            for worker in args.worker if k else ["thread"]:
                row = run(
                    exp, args.model, args.steps, k, latency, args.group, args.questions, worker, args.pin
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    sync = next(r for r in rows if r["max_staleness"] == 0)
    n = max(1, round(sync["tokens_per_episode"]))
    plain = plain_decode(args.model, exp, exp.rollout.batch_size, n, args.pin)
    for row in rows:
        if row["worker_tokens_per_s"] is not None:
            row["worker_vs_plain"] = row["worker_tokens_per_s"] / plain
    print(json.dumps({"plain_decode_tokens_per_s": plain, "rows": exp.rollout.batch_size, "tokens_each": n}))
    out = {
        "plain_decode_tokens_per_s": plain,
        "plain_decode_rows": exp.rollout.batch_size,
        "plain_decode_tokens_each": n,
        "model": args.model,
        "cpu": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "dtype": args.dtype,
        "pinned": args.pin,
        "questions_per_step": args.questions,
        "group_size": args.group,
        "overrides": args.overrides,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
