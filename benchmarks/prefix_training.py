"""Shared-prefix training (`trainer.share_prefix` with `trainer.packing`, `models.prefix`) against the same
micro-batches unshared: the training pass's forward + backward (the lean log-prob path, every action token
trained) in tokens/s and seconds per training batch, on four shapes of a GRPO step, each with and without
sharing in one run:

- ``quickstart``: the tag quickstart's model; 16 questions × 8 episodes, a 20-token prompt per question, 40-160
  tokens after it (actions and documents); micro-batches of 32;
- ``tools``: the same model with the tool quickstart's shape: a 244-token system prompt with the tool schema
  that every row begins with, a 16-token question, 60-240 tokens of turns; micro-batches of 32;
- ``instruct-1024`` / ``instruct-2048``: a random model at Qwen2.5-0.5B's width, heads and vocabulary (151,936)
  with ``--layers`` of its 24 layers (the CPU's time; every layer costs the same), one group of 8 episodes
  with a 1,024- or 2,048-token instruct prompt and 256 tokens each after it; micro-batches of 8.

Modes: ``padded`` (the trainer without packing), ``packed`` (``trainer.packing``, no sharing), ``shared``
(packing and sharing as a prefix tree), ``shared_kv`` (the micro-batch's common prefix once through the KV cache,
the rows after it padded or as a tree, whichever costs less: the trainer with packing where that prefix is
``trainer.prefix_cache_tokens`` long, 512 by default, `models.prefix_cache`), on a GPU ``flex`` (sharing through FlexAttention's block mask: measured, not a
trainer option, `shared_prefix.use_tree_attention`), and when asked ``prefix_kv`` (padded rows after the cached
common prefix: the trainer without packing).
Micro-batches are cut in token order (what the trainer does with sharing on) for every mode. Each (shape, mode)
runs in its own process (its peak resident memory is its own); the first round warms up, the best of
``--repeats`` is kept. Writes benchmarks/results/prefix_training.json.

    python benchmarks/prefix_training.py --model runs/quickstart/sft/final [--layers 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# name: (model, questions, group, system prompt, question prompt, (min, max) tokens after it, micro-batch)
SHAPES = {
    "quickstart": ("tiny", 16, 8, 0, 20, (40, 160), 32),
    "tools": ("tiny", 16, 8, 244, 16, (60, 240), 32),
    "instruct-1024": ("0.5b", 1, 8, 0, 1024, (256, 256), 8),
    "instruct-2048": ("0.5b", 1, 8, 0, 2048, (256, 256), 8),
}
# flex: on a GPU only (FlexAttention has no CPU backward); prefix_kv: only when asked (--modes)
MODES = ("padded", "packed", "shared", "shared_kv", "flex", "prefix_kv")


def model_of(
    kind: str,
    tiny_dir: str,
    layers: int,
    size: str = "qwen2.5-0.5b",
    dtype: str = "float32",
    device: str = "cpu",
):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from searchrl.models.lean_head import add_lean_head
    from searchrl.models.tiny import SIZES

    torch.manual_seed(0)
    if kind == "tiny":
        m = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=getattr(torch, dtype))
    else:  # a Qwen2.5 shape (``size``: its config.json's widths, heads and vocabulary), ``layers`` of its layers
        spec = SIZES[size]
        cfg = Qwen2Config(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=layers or spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=spec.tie_word_embeddings,
            attn_implementation="sdpa",
        )
        with torch.device(device):  # drawn where it runs (a 1.5B model's initialisation is slow on a CPU)
            m = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return add_lean_head(m.to(device))


def rows_of(shape: str, vocab: int, seed: int):
    """(ids, trained-from) per row: every row begins with the shared system prompt, then its question's
    prompt, then its own tokens (trained)."""
    import torch

    _, questions, group, system_n, prompt_n, (lo, hi), _ = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    system = torch.randint(3, vocab, (system_n,), generator=g).tolist()
    rows = []
    for _ in range(questions):
        prompt = system + torch.randint(3, vocab, (prompt_n,), generator=g).tolist()
        for _ in range(group):
            own = torch.randint(3, vocab, (rng.randint(lo, hi),), generator=g).tolist()
            rows.append((prompt + own, len(prompt)))
    return rows


def one(shape: str, mode: str, a: argparse.Namespace) -> dict:
    import torch

    tiny_dir, layers, repeats, seed = a.model, a.layers, a.repeats, a.seed
    model = model_of(SHAPES[shape][0], tiny_dir, layers, a.size, a.dtype, a.device)
    rows = sorted(
        rows_of(shape, model.config.vocab_size, seed), key=lambda r: r[0]
    )  # the trainer's token order
    micro = SHAPES[shape][6]
    batches = []
    for i in range(0, len(rows), micro):
        chunk = rows[i : i + micro]
        T = max(len(r) for r, _ in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        attn, mask = torch.zeros_like(ids), torch.zeros(len(chunk), T)
        for b, (r, first) in enumerate(chunk):
            ids[b, : len(r)], attn[b, : len(r)], mask[b, first : len(r)] = torch.tensor(r), 1, 1
        batches.append((ids.to(a.device), attn.to(a.device), mask.to(a.device)))
    from shared_prefix import timed_passes  # benchmarks/shared_prefix.py, beside this script

    times, run_tokens = timed_passes(model, batches, mode, repeats)
    real = sum(len(r) for r, _ in rows)
    best = min(times[1:])
    gpu = {}
    if a.device == "cuda":
        gpu = {"peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if a.breakdown and mode != "padded":  # the layout's share, measured in rounds of their own
        layout: list[float] = []
        synced = timed_passes(model, batches, mode, repeats, layout)[0]
        i = min(range(1, len(synced)), key=synced.__getitem__)
        gpu |= {"s_per_batch_synced": round(synced[i], 3), "layout_s": round(layout[i], 3)}
    if a.profile:  # one more round under torch.profiler: the operators that took the time
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with profile(activities=acts) as prof:
            timed_passes(model, batches, mode, 0)
        key = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        (Path(a.profile) / f"{a.size}-{shape}-{mode}.txt").write_text(
            prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
        )
    return {
        "shape": shape,
        "mode": mode,
        "rows": len(rows),
        "real_tokens": real,
        "tokens_run": run_tokens,
        "s_per_batch": round(best, 3),
        "tokens_per_s": round(real / best, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        **gpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="the tag quickstart's model directory (the tiny shapes)")
    p.add_argument(
        "--layers", type=int, default=2, help="layers of the Qwen2.5-shaped model (0: all of the size's)"
    )
    p.add_argument("--size", default="qwen2.5-0.5b", help="the instruct shapes' model: qwen2.5-0.5b or -1.5b")
    p.add_argument("--device", default="cpu", help="cpu, or cuda")
    p.add_argument("--dtype", default="float32", help="the models' dtype (bfloat16 on a GPU)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help=(
            "of padded, packed, shared, shared_kv, flex (a GPU), prefix_kv; default: the first four (and flex "
            "on a GPU)"
        ),
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prefix_training.json"))
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the packed layouts' construction (pack_shared, the mask) apart, the device synchronised",
    )
    p.add_argument(
        "--profile", default="", help="a folder: one profiled round per (shape, mode), top operators"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not a.child and not a.model and any(SHAPES[s][0] == "tiny" for s in a.shapes):
        p.error("--model: the tiny shapes (quickstart, tools) need the tag quickstart's model directory")
    if a.modes and not set(a.modes) <= set(MODES):
        p.error(f"--modes: {a.modes} are not all of {list(MODES)}")
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(one(spec["shape"], spec["mode"], a)))
        return
    results = []
    modes = a.modes or (MODES[:5] if a.device == "cuda" else MODES[:4])
    for shape in a.shapes:
        for mode in modes:
            cmd = [sys.executable, __file__, "--model", a.model, "--layers", str(a.layers), "--size", a.size]
            cmd += ["--device", a.device, "--dtype", a.dtype]
            cmd += ["--repeats", str(a.repeats), "--seed", str(a.seed)]
            cmd += ["--breakdown"] * a.breakdown + (["--profile", a.profile] if a.profile else [])
            cmd += ["--child", json.dumps({"shape": shape, "mode": mode})]
            out = (
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            r = json.loads(out)
            results.append(r)
            print(
                f"{shape:14s} {mode:7s}: {r['s_per_batch']:8.2f} s, {r['tokens_per_s']:9.0f} tok/s, "
                f"{r['tokens_run']:7d} tokens run for {r['real_tokens']} real, peak RSS {r['peak_rss_mb']} MB"
                + (
                    f", layout {r['layout_s']} of {r['s_per_batch_synced']} s synced"
                    if "layout_s" in r
                    else ""
                ),
                flush=True,
            )
    speedups = {}
    for shape in a.shapes:
        by = {r["mode"]: r for r in results if r["shape"] == shape}
        speedups[shape] = {  # those of the modes that ran
            f"shared_vs_{base}": round(by[base]["s_per_batch"] / by["shared"]["s_per_batch"], 2)
            for base in ("packed", "padded")
            if base in by and "shared" in by
        }
        for mode in ("shared_kv", "prefix_kv", "flex"):
            if mode in by and "padded" in by:
                speedups[shape][f"{mode}_vs_padded"] = round(
                    by["padded"]["s_per_batch"] / by[mode]["s_per_batch"], 2
                )
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "model": a.model,
        "qwen_shape": a.size,
        "qwen_shape_layers": a.layers,
        "device": __import__("torch").cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "dtype": a.dtype,
        "shapes": {
            k: dict(zip(("model", "questions", "group", "system", "prompt", "own", "micro"), v))
            for k, v in SHAPES.items()
            if k in a.shapes
        },
        "results": results,
        "speedup": speedups,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(speedups, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
