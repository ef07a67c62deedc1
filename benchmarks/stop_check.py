"""The stop check of the HF decode loops (`searchrl.rollout.decoding.TextStop`) per decode step: every running
row's newest ids decoded to find a closing tag that is text in the vocabulary, against the same check with
the vocabulary filter (only rows whose newest token's text can end a tag are decoded).

    python benchmarks/stop_check.py --tokenizer runs/qwen-tokenizer [--rows 64 256] [--steps 48]

``--tokenizer``: a tokenizer directory (`searchrl tokenizer qwen2.5 --out DIR` writes Qwen2.5's). Rows are
random ids of the vocabulary, as a random-weight model samples them (what the GPU benchmarks run), and the
tags are the search environment's. This is host time on the decode loop's critical path: on a GPU the next
forward waits for it. Writes benchmarks/results/stop_check.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from searchrl.rollout.decoding import TextStop

REPO = Path(__file__).resolve().parents[1]
STOPS = ("</search>", "</answer>")


def per_step(stop: TextStop, rows: list[list[int]], steps: int) -> float:
    """Seconds per decode step: every row checked once, for ``steps`` steps as the rows grow."""
    t = time.perf_counter()
    for k in range(1, steps + 1):
        for r in rows:
            stop(r[:k])
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "stop_check.json"))
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    filtered = TextStop(tok, STOPS)
    t = time.perf_counter()
    filtered([0])  # reads which tokens can end a tag, once per tokenizer
    setup = time.perf_counter() - t
    plain = TextStop(tok, STOPS)
    plain.ends = ""  # every row decoded at every step, as before the filter
    rng = random.Random(0)
    out = []
    for n in args.rows:
        rows = [[rng.randrange(len(tok)) for _ in range(args.steps)] for _ in range(n)]
        a, b = per_step(plain, rows, args.steps), per_step(filtered, rows, args.steps)
        out.append({"rows": n, "every_row_ms": a * 1e3, "filtered_ms": b * 1e3})
        print(f"{n} rows: {a * 1e3:.2f} ms a step decoding every row, {b * 1e3:.3f} ms with the filter")
    assert filtered._enders is not None
    result = {
        "tokenizer": args.tokenizer,
        "vocabulary": len(tok),
        "tokens_that_can_end_a_tag": len(filtered._enders[1]),
        "filter_setup_s": setup,
        "steps": args.steps,
        "results": out,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"filter read in {setup:.2f} s ({result['tokens_that_can_end_a_tag']} tokens); wrote {args.out}")


if __name__ == "__main__":
    main()
