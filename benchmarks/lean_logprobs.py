"""Peak memory and time of one training step's log-prob pass, lean (`models.lean_head`) against full logits.

    python benchmarks/lean_logprobs.py [--vocab 151936] [--tokens 2048] [--hidden 256] [--layers 2]

A Qwen2 model with Qwen2.5's vocabulary (151,936 rows) and a small trunk, one sequence of ``--tokens``
tokens of which ``--action-fraction`` are action tokens (the rest prompt and retrieved text), forward and
backward of a policy-gradient-shaped loss Σ w_t log p_t. Variants: ``full`` (the logits tensor), ``tiled``
(TRL's tiles, always), ``lean`` (the trainer's choice: the layer whole where the action tokens' logits fit in
one tile, `lean_head.DIRECT_LIMIT`, else the tiles). Each variant runs in its own process; peak memory is the
process's peak resident set size minus its size before the step. CPU numbers (this machine).

    python benchmarks/lean_logprobs.py --vocab 4096 --rows 16 --tokens 434 --hidden 128 --layers 4 \
        --action-fraction 1 --repeats 5
    (a micro-batch of the tool quickstart's warm start: its model's shape, 16 rows of ~434 tokens, loss on all)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(a: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from searchrl.core.functional import token_logprobs
    from searchrl.models import lean_head
    from searchrl.models.lean_head import add_lean_head
    from searchrl.models.policy import forward, forward_lean

    if a.variant == "tiled":
        lean_head.DIRECT_LIMIT = 0

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 4,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = add_lean_head(Qwen2ForCausalLM(cfg))
    ids = torch.randint(0, a.vocab, (a.rows, a.tokens))
    attention = torch.ones_like(ids)
    mask = (torch.rand(a.rows, a.tokens) < a.action_fraction).float()
    weights = torch.randn(a.rows, a.tokens)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if a.variant in ("lean", "tiled"):
            lp = forward_lean(model, ids, attention, mask, 1.0)[0]
        else:
            logits, _ = forward(model, ids, attention)
            lp = token_logprobs(logits, ids, 1.0, mask=mask)
        (lp * mask * weights).sum().backward()

    step()  # warm-up (allocator, lazy init)
    model.zero_grad(set_to_none=True)
    before = rss_mb()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": statistics.median(times), "peak_rss_mb": peak, "step_peak_mb": peak - before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=1, help="sequences of --tokens each in the pass")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--action-fraction", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variant", choices=["lean", "tiled", "full"], help=argparse.SUPPRESS
    )  # one process per variant
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args()
    if a.variant:
        print(json.dumps(one(a)))
        return
    rows = {}
    for variant in ("full", "tiled", "lean"):
        args = [a for a in sys.argv[1:] if not a.startswith("--out")]
        proc = subprocess.run(
            [sys.executable, __file__, *args, "--variant", variant],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    head = f"V={a.vocab}, {a.rows} x T={a.tokens}, hidden {a.hidden}, {a.layers} layers, {a.action_fraction:.0%} action tokens"
    lines = [
        f"# Log-prob pass of one training step (forward + backward), {head}",
        "",
        "| path | seconds | peak RSS (MB) | peak above the model (MB) |",
        "|---|---|---|---|",
    ]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} | {r['step_peak_mb']:.0f} |")
    ratio = rows["lean"]["step_peak_mb"] / max(rows["full"]["step_peak_mb"], 1e-9)
    lines.append(
        f"\nlean / full: memory above the model {ratio:.2f}, time {rows['lean']['seconds'] / rows['full']['seconds']:.2f}; "
        f"lean / tiled: time {rows['lean']['seconds'] / rows['tiled']['seconds']:.2f}"
    )
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"V{a.vocab}-T{a.tokens}-h{a.hidden}" + (f"-rows{a.rows}" if a.rows > 1 else "")
    (out / f"lean_logprobs-{tag}.json").write_text(json.dumps({"config": vars(a), "results": rows}, indent=1))
    (out / f"lean_logprobs-{tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
