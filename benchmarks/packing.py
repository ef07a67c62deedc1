"""Sequence packing (`trainer.packing`) against the padded training pass: tokens/s of a forward + backward of
the lean log-prob path, peak memory, and the padding fraction, on real episode lengths.

    python benchmarks/packing.py --model runs/quickstart/sft/final \
        --episodes runs/quickstart/eval/grpo-test.predictions.jsonl [--rows 128] [--micro 32] [--repeats 3]
    python benchmarks/packing.py --model runs/qwen2.5-0.5b-shape --episodes ... --rows 8 --micro 4

The episode lengths are the evaluation transcripts tokenized with the model's tokenizer (each episode as
the trainer sees it: prompt, actions, documents); the loss mask marks the tokens after the question.
Micro-batches are formed two ways: in the order the rows come (``shuffled``) and sorted by length (what the
trainer does before its updates, ``sorted``). Each (order, padded/packed) runs in its own process, so its peak
resident memory (ru_maxrss) is its own. Writes benchmarks/results/packing-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def lengths_of(model: str, episodes: str, rows: int, seed: int) -> list[tuple[int, int]]:
    """(tokens, question tokens) of ``rows`` evaluation transcripts, cycled if there are fewer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    recs = [json.loads(line) for line in Path(episodes).read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(recs)
    out = []
    for r in (recs * (rows // max(len(recs), 1) + 1))[:rows]:
        n = len(tok(r["transcript"])["input_ids"])
        q = len(tok("Question: " + r["question"])["input_ids"])
        out.append((n, min(q, n - 1)))
    return out


def one(
    model_dir: str, lens: list[tuple[int, int]], micro: int, order: str, packed: bool, repeats: int
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from searchrl.core.functional import masked_sum
    from searchrl.models.lean_head import add_lean_head
    from searchrl.models.packing import pack, padding_fraction
    from searchrl.models.policy import forward_lean

    torch.manual_seed(0)
    model = add_lean_head(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    vocab = model.config.vocab_size
    if order == "sorted":
        lens = sorted(lens)
    pads, packed_pads, times, tokens = [], [], [], 0
    for _ in range(repeats + 1):  # the first round warms up
        t0, pads, packed_pads = time.perf_counter(), [], []
        for i in range(0, len(lens), micro):
            chunk = lens[i : i + micro]
            T = max(n for n, _ in chunk)
            ids = torch.randint(3, vocab, (len(chunk), T))
            attn = (torch.arange(T)[None] < torch.tensor([n for n, _ in chunk])[:, None]).long()
            mask = attn.float() * (torch.arange(T)[None] >= torch.tensor([q for _, q in chunk])[:, None])
            pads.append(padding_fraction(attn) * attn.numel())
            if packed:
                p = pack(ids, attn, mask)
                packed_pads.append(p.input_ids.numel() - float(attn.sum()))
                lp, _, _ = forward_lean(
                    model, p.input_ids, None, p.loss_mask, 1.0, position_ids=p.position_ids
                )
                m = p.loss_mask
            else:
                lp, _, _ = forward_lean(model, ids, attn, mask, 1.0)
                m = mask
            masked_sum(lp, m).backward()
        times.append(time.perf_counter() - t0)
    tokens = sum(n for n, _ in lens)
    best = min(times[1:])
    return {
        "order": order,
        "packed": packed,
        "padding_frac_before": sum(pads) / (sum(pads) + tokens),
        "padding_frac": (sum(packed_pads) if packed else sum(pads))
        / ((sum(packed_pads) if packed else sum(pads)) + tokens),
        "s_per_pass": best,
        "tokens_per_s": tokens / best,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def in_own_process(script: str, a: argparse.Namespace, spec: str) -> dict:
    """``script --child SPEC`` with the run's model, episodes, micro-batch size and repeats, in a process of
    its own (so that its peak resident memory is its own): the JSON of its last output line."""
    cmd = [sys.executable, script, "--model", a.model, "--episodes", a.episodes, "--micro", str(a.micro)]
    cmd += ["--repeats", str(a.repeats), "--child", spec]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--episodes", required=True, help="a NAME.predictions.jsonl (its transcripts' lengths)")
    p.add_argument("--rows", type=int, default=128, help="sequences in the training batch")
    p.add_argument("--micro", type=int, default=32, help="trainer.micro_batch_size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="quickstart")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:  # one configuration, in its own process
        spec = json.loads(a.child)
        print(json.dumps(one(a.model, spec["lens"], a.micro, spec["order"], spec["packed"], a.repeats)))
        return
    lens = lengths_of(a.model, a.episodes, a.rows, a.seed)
    results = []
    for order in ("shuffled", "sorted"):
        for packed in (False, True):
            spec = json.dumps({"lens": lens, "order": order, "packed": packed})
            results.append(in_own_process(__file__, a, spec))
            r = results[-1]
            print(
                f"{order:9s} {'packed' if packed else 'padded'}: {r['tokens_per_s']:.0f} tok/s, "
                f"{r['s_per_pass']:.2f} s/pass, padding {r['padding_frac_before']:.3f} -> {r['padding_frac']:.3f}, "
                f"peak RSS {r['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    n = [x for x, _ in lens]
    summary = {
        "model": a.model,
        "rows": a.rows,
        "micro": a.micro,
        "lengths": {"min": min(n), "max": max(n), "mean": sum(n) / len(n)},
        "results": results,
    }
    out = Path(a.out) / f"packing-{a.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
