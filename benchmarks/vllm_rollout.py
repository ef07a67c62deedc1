"""Rollout throughput of the full multi-turn search loop: the vLLM backend (CPU build) against the HF
backend, on the same model, batch and environment. Run in the vLLM environment (see .ci/vllm):

    .venv-vllm/bin/python benchmarks/vllm_rollout.py --model runs/quickstart/sft/final --batch 64
    .venv-vllm/bin/python benchmarks/vllm_rollout.py --build-hidden 768 --build-layers 8 --batch 32

``--build-*`` makes a randomly initialised Qwen2 model of that shape (with the quickstart's tokenizer) to
measure a larger model; its actions are noise, so its episodes are invalid actions up to the turn budget.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from searchrl.app.experiment import load_experiment
from searchrl.app.resources import Resources
from searchrl.models.load import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import rollout

REPO = Path(__file__).resolve().parents[1]


def build(tokenizer_dir: str, hidden: int, layers: int, out: Path) -> str:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        intermediate_size=hidden * 11 // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "experiments" / "quickstart.yaml"))
    p.add_argument("--model", default=str(REPO / "runs" / "quickstart" / "sft" / "final"))
    p.add_argument("--build-hidden", type=int, default=0)
    p.add_argument("--build-layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()
    from searchrl.rollout.vllm import VLLMGenerator

    model_dir = args.model
    if args.build_hidden:
        model_dir = build(
            args.model,
            args.build_hidden,
            args.build_layers,
            Path("/tmp") / f"bench-qwen2-h{args.build_hidden}-l{args.build_layers}",
        )
    exp = load_experiment(args.config)
    resources = Resources(exp)
    env = resources.env()
    model, tok = load_model_and_tokenizer(model_dir)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    examples = resources.examples("test")[: args.batch]
    params = SamplingParams(exp.rollout.temperature, 1.0, exp.rollout.max_new_tokens)
    backends = {
        "hf": HFGenerator(model, tok, env.tags.stop_strings, batch_size=args.batch),
        "vllm": VLLMGenerator(
            model,
            tok,
            env.tags.stop_strings,
            batch_size=args.batch,
            gpu_memory_utilization=0.3,
            dtype="float32",
            max_model_len=exp.rollout.max_total_tokens,
        ),
    }
    rows = []
    for name, gen in backends.items():
        rollout(examples[:4], env, gen, tok, params, 1, exp.rollout.max_total_tokens)  # warm-up (compilation)
        for r in range(args.repeats):
            torch.manual_seed(r)
            t = time.perf_counter()
            _, stats = rollout(examples, env, gen, tok, params, 1, exp.rollout.max_total_tokens)
            s = time.perf_counter() - t
            rows.append(
                {
                    "backend": name,
                    "tokens": stats.tokens_generated,
                    "seconds": s,
                    "tok_s": stats.tokens_generated / s,
                    "turns": stats.actions / max(stats.episodes, 1),
                }
            )
    print(
        f"model {model_dir} ({n_params / 1e6:.1f}M parameters), batch {args.batch}, {torch.get_num_threads()} threads"
    )
    print("| backend | tokens | s | tok/s | actions/episode |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['tokens']} | {r['seconds']:.1f} | {r['tok_s']:.0f} | {r['turns']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"h{args.build_hidden}-l{args.build_layers}" if args.build_hidden else "small"
    (out / f"vllm_rollout-{tag}-b{args.batch}.json").write_text(
        json.dumps({"model": model_dir, "params": n_params, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
