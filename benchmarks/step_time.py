"""One GRPO step, ours against TRL's `GRPOTrainer` driving the same multi-turn search loop through its
`rollout_func`, on the same model, questions per step, group size, lengths and micro-batch size.

    python benchmarks/step_time.py --model runs/quickstart/sft/final --steps 4

TRL's `rollout_func` drives our HF backend (KV cache kept across turns, stops at tags) in one batched
generation per turn (`rollout.loop: turn`), as a user's rollout function around batched generation would;
ours runs with its defaults (the per-episode loop) and, for the breakdown, with the turn loop too, and
(``--order … compiled``) with ``rollout.compile`` and ``rollout.prefix_sharing``. The first
step of each is a warm-up and is not counted. Target (issue 19): ours <= 0.5x TRL's time per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from searchrl.algorithms import algorithm_config
from searchrl.app.experiment import load_experiment
from searchrl.app.resources import Resources
from searchrl.app.train import default_cuda_allocator
from searchrl.core.config import SamplesConfig, TrainerConfig
from searchrl.engine.trainer import Trainer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import rollout

REPO = Path(__file__).resolve().parents[1]


# --order's names: the results' keys (compiled: the per-episode loop through the captured decode step, with
# prefix sharing: rollout.compile and rollout.prefix_sharing)
RUNS = {"episode": "ours", "turn": "ours (turn loop)", "trl": "trl", "compiled": "ours (compiled)"}
BREAKDOWN: dict[str, list[dict]] = {}  # run name -> each step's breakdown (ours only)
RUN = [""]  # the run in progress


def sync() -> None:
    """A GPU runs asynchronously: wait for it before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _alloc_stats() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {
        "cuda_mallocs": st.get("segment.all.allocated", 0),
        "alloc_retries": st.get("num_alloc_retries", 0),
    }


def ours(
    exp, resources, model: str, steps: int, questions: int, micro: int, loop: str = "episode"
) -> list[float]:
    cfg = TrainerConfig(
        steps=steps,
        batch_size=questions,
        micro_batch_size=micro,
        lr=1e-4,
        save_every=10**9,
        log_entropy=False,
        samples=SamplesConfig(groups=0),  # a timing: no training samples written
    )
    tr = Trainer(
        algorithm="grpo",
        config=algorithm_config("grpo", {"group_size": exp.algorithm.args["group_size"], "kl_coef": 0.001}),
        model_path=model,
        cfg=cfg,
        out_dir=Path(tempfile.mkdtemp()),
        resources=resources,
        seed=0,
    )
    gen = tr.ctx.generator
    assert gen is not None
    gen.continuous = loop == "episode"
    times = []
    for s in range(steps):
        graphs = getattr(gen, "_graphs", None)
        n0, c0 = (graphs.captures, graphs.capture_s) if graphs is not None else (0, 0.0)
        mem0 = _alloc_stats()
        t = time.perf_counter()
        m = tr.step(s)
        sync()
        times.append(time.perf_counter() - t)
        # where the step's time went: collection (rollout, rewards) against the training passes, the tokens
        # generated and trained, and decode graphs captured during the step (rollout.compile)
        BREAKDOWN.setdefault(RUN[0], []).append(
            {
                "step_s": round(times[-1], 3),
                "collect_s": round(m.get("time/collect_s", float("nan")), 3),
                "train_s": round(times[-1] - m.get("time/collect_s", 0.0), 3),
                "action_tokens": int(m.get("train/action_tokens", 0)),
                "sequences": int(m.get("train/sequences", 0)),
                "graphs_captured": (graphs.captures - n0) if graphs is not None else 0,
                "capture_s": round(graphs.capture_s - c0, 3) if graphs is not None else 0.0,
                "gpu_reserved_gb": round(torch.cuda.memory_reserved() / 2**30, 2)
                if torch.cuda.is_available()
                else 0.0,
                # the caching allocator's calls to cudaMalloc (segments) and its free-and-retry passes
                **{k: v - mem0[k] for k, v in _alloc_stats().items()},
            }
        )
    return times


def trl(
    exp, resources, model: str, steps: int, questions: int, micro: int, device: str = "cpu"
) -> list[float]:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from searchrl.core.answers import exact_match

    env = resources.env()
    examples = resources.examples("train")
    by_prompt = {env.reset(ex).prompt: ex for ex in examples}
    G = exp.algorithm.args["group_size"]
    params = SamplingParams(exp.rollout.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens)

    def rollout_func(prompts, trainer):
        unique = len(set(prompts)) == len(prompts)
        exs = [by_prompt[p] for p in prompts]
        gen = HFGenerator(
            trainer.model, trainer.processing_class, env.tags.stop_strings, batch_size=128, continuous=False
        )
        trajs, _ = rollout(
            exs, env, gen, trainer.processing_class, params, G if unique else 1, exp.rollout.max_total_tokens
        )
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "em": []}
        for t in trajs:
            out["prompt_ids"].append(t.segments[0].token_ids)
            ids, lps, mask = [], [], []
            for seg in t.segments[1:]:
                ids += seg.token_ids
                lps += seg.logprobs if seg.kind == "action" and seg.logprobs else [0.0] * len(seg.token_ids)
                mask += [1 if seg.kind == "action" else 0] * len(seg.token_ids)
            out["completion_ids"].append(ids)
            out["logprobs"].append(lps)
            out["env_mask"].append(mask)
            out["em"].append(exact_match(t.answer or "", t.example.answers))
        return out

    def em_reward(completions, em, **_):
        return em

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            times.append(time.perf_counter() - self.t)

    ds = Dataset.from_list([{"prompt": p} for p in by_prompt])
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=questions * G // micro,
        num_generations=G,
        max_completion_length=exp.rollout.max_total_tokens,
        learning_rate=1e-4,
        beta=0.001,
        temperature=exp.rollout.temperature,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=device == "cpu",
        bf16=exp.model.dtype == "bfloat16",
        model_init_kwargs={"dtype": exp.model.dtype},  # the weights in the dtype ours trains in
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[em_reward],
        args=args,
        train_dataset=ds,
        rollout_func=rollout_func,
        callbacks=[Timer()],
    )
    trainer.train()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda (both trainers on the GPU)")
    p.add_argument("--dtype", default="float32", help="model.dtype of both trainers (bfloat16 on a GPU)")
    p.add_argument("--tag", default="step_time", help="results file: <tag>.json")
    p.add_argument(
        "--order",
        nargs="+",
        choices=list(RUNS),
        default=list(RUNS),
        help="which trainers run, in this order (the first pays for warming the device up: on a GPU, "
        "kernel plans for shapes not seen yet)",
    )
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=0.0,
        help="allocate and free this many GiB on the GPU first, so that the caching allocator holds them",
    )
    a = p.parse_args()
    exp = load_experiment(a.config, [f"model.dtype={a.dtype}"])
    # the allocator `searchrl train` gives its processes (expandable segments) unless PYTORCH_CUDA_ALLOC_CONF is
    # set, before anything starts CUDA; TRL's run in this process gets it too
    default_cuda_allocator(exp)
    if a.reserve_gb and a.device == "cuda":  # the cache keeps the block: later tensors are cut from it
        del_me = torch.empty(int(a.reserve_gb * 2**30), dtype=torch.uint8, device="cuda")
        del del_me
    resources = Resources(exp)
    res = {}
    for name in a.order:
        torch.manual_seed(0)
        RUN[0] = RUNS[name]
        if name == "trl":
            res[RUNS[name]] = trl(exp, resources, a.model, a.steps, a.questions, a.micro, a.device)
        elif name == "compiled":
            fast = load_experiment(
                a.config, [f"model.dtype={a.dtype}", "rollout.compile=true", "rollout.prefix_sharing=true"]
            )
            res[RUNS[name]] = ours(fast, Resources(fast), a.model, a.steps, a.questions, a.micro)
        else:
            res[RUNS[name]] = ours(exp, resources, a.model, a.steps, a.questions, a.micro, loop=name)
    summary = {k: statistics.mean(v[1:]) if len(v) > 1 else v[0] for k, v in res.items()}
    print(
        f"{a.questions} questions x {exp.algorithm.args['group_size']} samples per step, micro-batch {a.micro}"
    )
    print("| trainer | seconds per step (mean after warm-up) | all steps |\n|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {summary[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    for k, rows in BREAKDOWN.items():
        print(f"{k}, per step: " + "; ".join(json.dumps(r) for r in rows))
    ratio = summary["ours"] / summary["trl"] if {"ours", "trl"} <= set(summary) else None
    if ratio is not None:
        print(f"ours / TRL = {ratio:.2f} (target <= 0.5)")
    compiled = (
        summary[RUNS["compiled"]] / summary["trl"] if {RUNS["compiled"], "trl"} <= set(summary) else None
    )
    if compiled is not None:
        print(f"ours (compiled) / TRL = {compiled:.2f} (target <= 0.5)")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{a.tag}.json").write_text(
        json.dumps(
            {
                "steps": res,
                "breakdown": BREAKDOWN,
                "mean": summary,
                "ours_vs_trl": ratio,
                "compiled_vs_trl": compiled,
                "order": a.order,
                "threads": torch.get_num_threads(),
                "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                "dtype": a.dtype,
                "model": a.model,
                "questions": a.questions,
                "group_size": exp.algorithm.args["group_size"],
                "micro_batch": a.micro,
                "reserve_gb": a.reserve_gb,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
