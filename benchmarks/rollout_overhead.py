"""Rollout overhead: tokens/s of the multi-turn search loop (BM25, observations appended, env parsing) in both
loops (``episode``: each episode advances on its own through a continuous batch; ``turn``: one batched
generation per turn), against plain batched generation of the same model, batch size and number of
generated tokens (no environment, no observations: the ceiling).

    python benchmarks/rollout_overhead.py --model runs/quickstart/sft/final --batch 16 64 256
    .venv-vllm/bin/python benchmarks/rollout_overhead.py --backend vllm --model runs/quickstart/sft/final

HF: the ceiling is transformers' `generate` (and, for reference, our own decode loop with no stops). vLLM
(run in the environment .ci/vllm builds): the ceiling is vLLM's own `generate` with ``min_tokens`` equal to
``max_tokens``. Also: model forward calls and rows per call (HF), turns per episode, and how rollout time
grows with batch size and with the turn budget (``--turns``). Target (issue 19): episode loop >= 0.9x the
ceiling at batch 64 and 256. Writes benchmarks/results/rollout_overhead-<backend>.json.

Loops (``--loops``, HF backend): ``episode`` and ``turn`` as above; ``compiled`` the per-episode loop through
the captured decode step (``rollout.compile``: CUDA graphs on a GPU, torch.compile on a CPU); ``shared`` with
prefix sharing (``rollout.prefix_sharing``); ``compiled-shared`` both. A loop's generator is kept across the
warm-up and the timed passes (its graphs are captured once, in the warm-up). ``--group G`` runs G episodes per
question (a GRPO group: G equal prompts). ``--decode-json`` merges a summary into benchmarks/results/decode.json
(issue 53): on a CPU ``{"cpu": {NAME: {"off_tok_s", "on_tok_s"}}}`` (episode without and with prefix sharing),
on a GPU ``{"gpu": {"<NAME>-<batch>": {"eager_tok_s", "compiled_tok_s", "generate_tok_s",
"episode_over_generate", "bandwidth_bound_tok_s"}}}``, where the bound is the batch's tokens per step at the
memory bandwidth measured here (one read of the weights per decode step; KV reads aside).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from searchrl.app.experiment import load_experiment
from searchrl.app.resources import Resources
from searchrl.models.load import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import encode, rollout

REPO = Path(__file__).resolve().parents[1]


class Forwards:
    """Counts a model's forward calls and the rows they carry (a pre-hook: the model is called unwrapped,
    so it keeps every argument it supports, e.g. ``logits_to_keep``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = self.rows = 0
        self.model = model
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def on(self, on: bool) -> None:
        """Count (True) or not: a captured decode step runs a model's hooks only when it is captured (a CUDA
        graph replays kernels), and torch.compile would specialise on the counter."""
        self.handle.remove()
        if on:
            self.handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _m: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.rows += 0 if ids is None else ids.shape[0]

    def reset(self) -> None:
        self.calls = self.rows = 0


def sync(model: Any) -> None:
    """Wait for the model's device (a GPU runs asynchronously: a host clock read before this undercounts)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def hf_plain(model: Any, tok: Any, prompts: list[list[int]], n: int, temperature: float) -> float:
    """Seconds for transformers' `generate` to sample exactly ``n`` tokens for every prompt."""
    L = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), L), tok.pad_token_id, device=model.device)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(prompts):
        ids[i, L - len(x) :] = torch.tensor(x)
        mask[i, L - len(x) :] = 1
    sync(model)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            pad_token_id=tok.pad_token_id,
        )
    assert out.shape[1] - L == n
    sync(model)
    return time.perf_counter() - t


def own_plain(model: Any, tok: Any, prompts: list[list[int]], n: int, temperature: float) -> float:
    """Seconds for our HF decode loop (`HFGenerator.generate`, no stop tags, EOS ignored) to sample ``n``
    tokens for every prompt: the loop's own decode speed without the environment."""
    gen = HFGenerator(model, tok, (), batch_size=len(prompts), continuous=False)
    gen.eos_ids = set()
    config = model.generation_config  # its end ids join the generator's at each call: none for this one
    eos = config.eos_token_id
    config.eos_token_id = None
    try:
        t = time.perf_counter()
        out = gen.generate(prompts, SamplingParams(temperature, 1.0, n))
        s = time.perf_counter() - t
    finally:
        config.eos_token_id = eos
    assert all(len(g.token_ids) == n for g in out), sorted({len(g.token_ids) for g in out})
    return s


def vllm_plain(gen: Any, prompts: list[list[int]], n: int, temperature: float) -> float:
    """Seconds for vLLM's own `generate` to sample exactly ``n`` tokens for every prompt."""
    sp = gen._vllm.SamplingParams(
        temperature=temperature, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
    )
    t = time.perf_counter()
    out = gen.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n for o in out)
    return time.perf_counter() - t


def profile_loops(
    args: Any, env: Any, generator: Any, tok: Any, params: Any, test: list, max_total: int
) -> None:
    """One rollout of each loop under torch.profiler: where each decode step's host time goes."""
    from torch.profiler import ProfilerActivity, profile

    batch = args.batch[0]
    examples = (test * (batch // len(test) + 1))[:batch]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for loop in args.loops:
        gen = generator(batch, loop, env)
        # once untimed: on a GPU the first pass at a batch size builds cuDNN attention's plans (H200: 1.8 ms of
        # host time per attention call cold against 0.11 warm), which the loop profiled first would pay alone
        rollout(examples, env, gen, tok, params, 1, max_total)
        torch.manual_seed(0)
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            rollout(examples, env, gen, tok, params, 1, max_total)
        s = time.perf_counter() - t
        table = prof.key_averages()
        text = [f"{loop} loop, batch {batch}: {s:.2f} s under the profiler\n", "by self CPU time (host):"]
        text.append(table.table(sort_by="self_cpu_time_total", row_limit=30))
        if torch.cuda.is_available():
            text += ["by device time:", table.table(sort_by="self_device_time_total", row_limit=20)]
        name = f"{args.tag or 'rollout_overhead-' + args.backend}-profile-{loop}.txt"
        (out / name).write_text("\n".join(text))
        print(f"profile of the {loop} loop: {out / name}")


LOOPS: dict[str, dict[str, Any]] = {  # loop name -> HFGenerator options
    "episode": {"continuous": True},
    "turn": {"continuous": False},
    "compiled": {"continuous": True, "compile": True},
    "shared": {"continuous": True, "prefix_sharing": True},
    "compiled-shared": {"continuous": True, "compile": True, "prefix_sharing": True},
}


def bandwidth_gb_s(device: str) -> float | None:
    """The device's memory bandwidth: bytes read and written by a 1 GiB device-to-device copy, per second."""
    if device != "cuda":
        return None
    x = torch.empty(2**28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 4 * 10 / (time.perf_counter() - t) / 1e9


def write_decode(args: Any, result: dict[str, Any], model: Any) -> None:
    """Merge this run's summary into ``--decode-json`` (module docstring)."""
    path = Path(args.decode_json)
    data = json.loads(path.read_text()) if path.exists() else {}
    name = args.decode_name or Path(args.config).stem
    for batch, b in result["batches"].items():
        med = b["median_tok_s"]
        if model.device.type == "cuda":
            weights = sum(x.numel() * x.element_size() for x in model.parameters())
            row = {
                "device": result["device"],
                "eager_tok_s": med.get("episode"),
                "compiled_tok_s": med.get("compiled"),
                "generate_tok_s": med.get("plain"),
                "episode_over_generate": (
                    med["compiled"] / med["plain"] if "compiled" in med and "plain" in med else None
                ),
                "eager_over_generate": med["episode"] / med["plain"]
                if {"episode", "plain"} <= set(med)
                else None,
                "bandwidth_gb_s": result["bandwidth_gb_s"],
                "bandwidth_bound_tok_s": batch * result["bandwidth_gb_s"] * 1e9 / weights,
                "capture_s": b.get("capture_s"),
            }
            data.setdefault("gpu", {})[f"{name}-{batch}"] = row
        else:
            row = {
                "batch": batch,
                "group": args.group,
                "threads": result["threads"],
                "off_tok_s": med.get("episode"),
                "on_tok_s": med.get("shared"),
                "speedup": med["shared"] / med["episode"] if {"shared", "episode"} <= set(med) else None,
            }
            data.setdefault("cpu", {})[name] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"summary merged into {path}")


def cell(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    """The median of ``key`` over repeats, or '-' where that measurement does not have it."""
    vals = [r[key] for r in rows if key in r]
    return format(statistics.median(vals), fmt) if vals else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument(
        "--model", required=True, help="a trained model directory (e.g. the quickstart's SFT model)"
    )
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument(
        "--loops",
        nargs="+",
        default=["episode", "turn"],
        choices=list(LOOPS),
        help="which loops to time (HF backend): " + ", ".join(LOOPS),
    )
    p.add_argument("--group", type=int, default=1, help="episodes per question (GRPO's group size)")
    p.add_argument(
        "--no-plain", action="store_true", help="skip the ceilings (transformers' generate, our plain decode)"
    )
    p.add_argument("--decode-json", default=None, help="merge a summary into this file (decode.json)")
    p.add_argument("--decode-name", default=None, help="the summary's key (an experiment, or a model shape)")
    p.add_argument("--turns", type=int, nargs="*", default=[1, 2, 3, 5], help="turn budgets at batch 64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed passes of each loop at each batch size before the timed ones",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="turn off cuDNN's scaled-dot-product attention (GPU): flash / memory-efficient kernels build no plans",
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--device", default="cpu", help="cpu or cuda (the HF backend's model)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 (the HF backend's model)")
    p.add_argument(
        "--tag", default=None, help="results file: <tag>.json (default: rollout_overhead-<backend>)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one rollout of each loop at the first batch size (torch.profiler, HF backend): "
        "<tag>-profile-<loop>.txt, operators by self CPU time (host overhead) and by device time",
    )
    args = p.parse_args()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    exp = load_experiment(args.config)
    resources = Resources(exp)
    model, tok = load_model_and_tokenizer(args.model, dtype=args.dtype)
    model.to(args.device).eval()
    counter = Forwards(model)
    T = exp.rollout.temperature
    params = SamplingParams(T, 1.0, exp.rollout.max_new_tokens)
    test = resources.examples("test")
    vgen = None
    if args.backend == "vllm":
        from searchrl.rollout.vllm import VLLMGenerator

        vgen = VLLMGenerator(
            model,
            tok,
            resources.env().stop_strings,
            batch_size=max(args.batch),
            gpu_memory_utilization=0.3,
            dtype="float32",
            max_model_len=exp.rollout.max_total_tokens,
        )

    made: dict[tuple[int, str, int], Any] = {}

    def generator(batch: int, loop: str, env: Any) -> Any:
        if vgen is not None:
            vgen.continuous = loop == "episode"
            return vgen
        key = (batch, loop, id(env))
        if key not in made:  # kept: a compiled loop's graphs are captured once per run
            made[key] = HFGenerator(model, tok, env.stop_strings, batch_size=batch, **LOOPS[loop])
        return made[key]

    loops = args.loops if vgen is None else [x for x in args.loops if x in ("episode", "turn")]

    def measure(batch: int, env: Any) -> dict[str, Any]:
        questions = max(1, batch // args.group)
        examples = (test * (questions // len(test) + 1))[:questions]
        prompts = [encode(tok, env.reset(ex).prompt) for ex in examples for _ in range(args.group)]
        rows = []
        for _ in range(args.warmup):  # untimed: each loop's first pass at this batch size (see profile_loops)
            for loop in loops:
                counter.on(not LOOPS[loop].get("compile"))
                rollout(
                    examples,
                    env,
                    generator(batch, loop, env),
                    tok,
                    params,
                    args.group,
                    exp.rollout.max_total_tokens,
                )
        for r in range(args.repeats):
            row: dict[str, Any] = {}
            for loop in loops:
                gen = generator(batch, loop, env)
                compiled = bool(LOOPS[loop].get("compile"))
                counter.on(not compiled)
                torch.manual_seed(r)
                counter.reset()
                t = time.perf_counter()
                _, stats = rollout(examples, env, gen, tok, params, args.group, exp.rollout.max_total_tokens)
                s = time.perf_counter() - t
                row[loop] = {
                    "tokens": stats.tokens_generated,
                    "s": s,
                    "tok_s": stats.tokens_generated / s,
                    "turns_per_episode": stats.actions / max(stats.episodes, 1),
                }
                if vgen is None and not compiled:  # the HF model's forward calls (vLLM: its own weights)
                    row[loop]["forwards"] = counter.calls
                    row[loop]["rows_per_forward"] = counter.rows / max(counter.calls, 1)
                if vgen is None:
                    row[loop]["shared_tokens"] = gen.shared_tokens
            counter.on(True)
            rows.append(row)
            if args.no_plain:
                continue
            n = max(1, round(row[loops[0]]["tokens"] / len(prompts)))  # the first loop's tokens, in one turn
            torch.manual_seed(r)
            if vgen is not None:
                s = vllm_plain(vgen, prompts, n, T)
                row["plain"] = {"tokens": n * batch, "s": s, "tok_s": n * batch / s}
            else:
                counter.reset()
                s = hf_plain(model, tok, prompts, n, T)
                row["plain"] = {
                    "tokens": n * batch,
                    "s": s,
                    "tok_s": n * batch / s,
                    "forwards": counter.calls,
                }
                s = own_plain(model, tok, prompts, n, T)
                row["own_plain"] = {"tokens": n * batch, "s": s, "tok_s": n * batch / s}
        kinds = list(rows[0])
        med = {k: statistics.median(r[k]["tok_s"] for r in rows) for k in kinds}
        out: dict[str, Any] = {
            "rows": rows,
            "median_tok_s": med,
            "seconds_episode": statistics.median(r[loops[0]]["s"] for r in rows),
        }
        for k in kinds:
            if k in LOOPS and "plain" in med:
                out[f"{k}_vs_plain"] = med[k] / med["plain"]
        graphs = [g._graphs for (b, _, _), g in made.items() if b == batch and getattr(g, "_graphs", None)]
        if graphs:
            out["captures"] = sum(g.captures for g in graphs)
            out["capture_s"] = sum(g.capture_s for g in graphs)
        return out

    env = resources.env()
    warm = generator(16, "episode", env)
    rollout(
        test[:16], env, warm, tok, params, 1, exp.rollout.max_total_tokens
    )  # BM25's JIT, allocator, engine
    if args.profile and vgen is None:
        profile_loops(args, env, generator, tok, params, test, exp.rollout.max_total_tokens)
    result: dict[str, Any] = {
        "backend": args.backend,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "model": args.model,
        "parameters": sum(x.numel() for x in model.parameters()),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cudnn_sdpa": not args.no_cudnn_sdpa,
        "loops": loops,
        "group": args.group,
        "bandwidth_gb_s": bandwidth_gb_s(model.device.type),
        "batches": {},
        "turn_budgets": {},
    }
    for batch in args.batch:
        b = result["batches"][batch] = measure(batch, env)
        print(
            f"\nbatch {batch} ({args.backend}, {torch.get_num_threads()} threads, median of {args.repeats})"
        )
        print(
            "| loop | tok/s | s | tokens | forwards | rows/forward | turns/episode |\n|---|---|---|---|---|---|---|"
        )
        for k in b["median_tok_s"]:
            rs = [r[k] for r in b["rows"]]
            print(
                f"| {k} | {b['median_tok_s'][k]:.0f} | {statistics.median(x['s'] for x in rs):.2f} | "
                f"{statistics.median(x['tokens'] for x in rs):.0f} | "
                f"{cell(rs, 'forwards', '.0f')} | {cell(rs, 'rows_per_forward', '.1f')} | "
                f"{cell(rs, 'turns_per_episode', '.2f')} |"
            )
        print(", ".join(f"{k[:-9]} / plain = {v:.2f}" for k, v in b.items() if k.endswith("_vs_plain")))
        if "captures" in b:
            print(f"graphs captured: {b['captures']} in {b['capture_s']:.2f} s")
    if args.turns:
        print("\nrollout time by turn budget, batch 64 (episode loop)")
        print("| env.max_turns | turns/episode | tokens | s | episode / plain |\n|---|---|---|---|---|")
        for turns in args.turns:
            budget = copy.copy(env)
            budget.max_turns = turns
            t = result["turn_budgets"][turns] = measure(64, budget)
            rs = [r[loops[0]] for r in t["rows"]]
            ratio = t.get(f"{loops[0]}_vs_plain")
            print(
                f"| {turns} | {statistics.median(x['turns_per_episode'] for x in rs):.2f} | "
                f"{statistics.median(x['tokens'] for x in rs):.0f} | {t['seconds_episode']:.2f} | "
                f"{'-' if ratio is None else format(ratio, '.2f')} |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag or 'rollout_overhead-' + args.backend}.json").write_text(json.dumps(result, indent=1))
    if args.decode_json:
        write_decode(args, result, model)


if __name__ == "__main__":
    main()
