"""Rollout overhead: tokens/s of the full multi-turn search loop (BM25, observations appended, env parsing)
against plain batched `model.generate` of the same model, batch size and number of generated tokens.

    python benchmarks/rollout_overhead.py --model runs/quickstart/sft/final --batch 64

Uses the quickstart's world and environment settings. Target: loop >= 0.8x plain generate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from searchrl.experiment import load_experiment
from searchrl.models.load import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import encode, rollout
from searchrl.runtime import Runtime

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument(
        "--model", required=True, help="a trained model directory (e.g. the quickstart's SFT model)"
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-reuse", action="store_true", help="re-prefill the whole context every turn")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    exp = load_experiment(args.config)
    rt = Runtime(exp)
    env = rt.env()
    model, tok = load_model_and_tokenizer(args.model)
    model.eval()
    examples = rt.examples("test")[: args.batch]
    params = SamplingParams(exp.rollout.temperature, 1.0, exp.rollout.max_new_tokens)
    gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=args.batch, reuse_cache=not args.no_reuse)
    rows = []
    for r in range(args.repeats):
        torch.manual_seed(r)
        t = time.perf_counter()
        _, stats = rollout(examples, env, gen, tok, params, 1, exp.rollout.max_total_tokens)
        loop_s = time.perf_counter() - t
        n_tokens = stats.tokens_generated
        per_seq = max(1, n_tokens // len(examples))
        prompts = [encode(tok, env.reset(ex).prompt) for ex in examples]
        L = max(len(x) for x in prompts)
        ids = torch.full((len(prompts), L), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(prompts):
            ids[i, L - len(x) :] = torch.tensor(x)
            mask[i, L - len(x) :] = 1
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=per_seq,
                min_new_tokens=per_seq,
                do_sample=True,
                temperature=params.temperature,
                pad_token_id=tok.pad_token_id,
            )
        plain_s = time.perf_counter() - t
        plain_tokens = (out.shape[1] - L) * len(prompts)
        rows.append(
            {
                "loop_tokens": n_tokens,
                "loop_s": loop_s,
                "loop_tok_s": n_tokens / loop_s,
                "plain_tokens": plain_tokens,
                "plain_s": plain_s,
                "plain_tok_s": plain_tokens / plain_s,
                "turns_per_episode": stats.actions / max(stats.episodes, 1),
            }
        )
    best = {k: max(r[k] for r in rows) for k in ("loop_tok_s", "plain_tok_s")}
    ratio = best["loop_tok_s"] / best["plain_tok_s"]
    print(f"batch {args.batch}, model {args.model}, KV reuse across turns: {not args.no_reuse}")
    print(
        "| run | loop tokens | loop tok/s | plain tokens | plain tok/s | turns/episode |\n|---|---|---|---|---|---|"
    )
    for i, r in enumerate(rows):
        print(
            f"| {i} | {r['loop_tokens']} | {r['loop_tok_s']:.0f} | {r['plain_tokens']} | {r['plain_tok_s']:.0f} | "
            f"{r['turns_per_episode']:.2f} |"
        )
    print(f"best loop / best plain = {ratio:.2f} (target >= 0.8)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-noreuse" if args.no_reuse else ""
    (out / f"rollout_overhead-b{args.batch}{suffix}.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio": ratio,
                "kv_reuse": not args.no_reuse,
                "threads": torch.get_num_threads(),
                "reused_prompt_tokens": gen.reused_tokens,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
