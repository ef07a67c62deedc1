"""Shared contexts (`trainer.share_prefix`, `models.prefix`) on SLATE's training batch: k candidate actions
of one step from each recorded state, against the padded pass and plain packing (`trainer.packing` alone).
Tokens/s of a forward + backward of the lean log-prob path, tokens the model actually runs, peak memory.

    python benchmarks/shared_prefix.py --model runs/quickstart/sft/final \
        --episodes runs/quickstart/eval/grpo-test.predictions.jsonl [--states 16] [--k 5] [--micro 20]

States are prefixes of real evaluation transcripts (tokenized with the model's tokenizer, cut at a random
point after the question); each candidate adds an action of 8-48 tokens (the quickstart's max_new_tokens is
48), all trained. Micro-batches keep a state's candidates together, as the trainer's length order does for
equal states. Each configuration runs in its own process, so its peak resident memory is its own. Writes
benchmarks/results/shared-prefix-NAME.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
MODES = ("padded", "packed", "shared")


def batch_of(model: str, episodes: str, states: int, k: int, seed: int) -> list[tuple[int, int, int]]:
    """(state, context tokens, action tokens) for ``states`` x ``k`` candidates."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    recs = [json.loads(line) for line in Path(episodes).read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(recs)
    out = []
    for state, r in enumerate((recs * (states // max(len(recs), 1) + 1))[:states]):
        n = len(tok(r.get("transcript") or "".join(s["text"] for s in r["segments"]))["input_ids"])
        q = len(tok("Question: " + r["question"])["input_ids"])
        ctx = rng.randint(min(q + 1, n), n)
        out += [(state, ctx, rng.randint(8, 48)) for _ in range(k)]
    return out


def one(model_dir: str, rows: list[tuple[int, int, int]], micro: int, mode: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from searchrl.models.lean_head import add_lean_head

    torch.manual_seed(0)
    model = add_lean_head(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    contexts: dict[int, torch.Tensor] = {}
    batches = []
    for i in range(0, len(rows), micro):
        chunk = rows[i : i + micro]
        T = max(c + a for _, c, a in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        attn, mask = torch.zeros_like(ids), torch.zeros(len(chunk), T)
        for b, (state, c, a) in enumerate(chunk):
            ctx = contexts.setdefault(
                state, torch.randint(3, vocab, (c,), generator=g)
            )  # a state's candidates
            ids[b, :c], ids[b, c : c + a] = ctx, torch.randint(3, vocab, (a,), generator=g)
            attn[b, : c + a], mask[b, c : c + a] = 1, 1
        batches.append((ids, attn, mask))
    times, run_tokens = timed_passes(model, batches, mode, repeats)
    real = sum(c + a for _, c, a in rows)
    best = min(times[1:])
    return {
        "mode": mode,
        "real_tokens": real,
        "tokens_run": run_tokens,
        "s_per_pass": best,
        "tokens_per_s": real / best,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


TREE_ATTENTION = "bench_tree"


def _tree_attention(module, query, key, value, attention_mask, **kwargs):
    """FlexAttention where the mask is a block mask, transformers' SDPA kernel for every other mask."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(attention_mask, BlockMask):
        return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_tree_attention(model) -> None:
    """Mode ``flex``: ``model`` (a transformers model loaded with SDPA, on a CUDA device: FlexAttention has no
    backward on a CPU; head size a power of two, for its Triton kernel) given `_tree_attention`. Measured on an
    H200 against the dense tree mask through cuDNN's SDPA and not adopted by the trainer (docs/benchmarks.md)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if model.config._attn_implementation != "sdpa" or not next(model.parameters()).is_cuda:
        raise SystemExit("mode flex needs a CUDA device and a model loaded with SDPA")
    AttentionInterface.register(TREE_ATTENTION, _tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(TREE_ATTENTION)


def cached_prefix_logprobs(model, ids, attn, mask, packed=False):
    """Modes ``prefix_kv`` and ``shared_kv``: the trainer's path with ``trainer.prefix_cache_tokens`` (the
    micro-batch's common prefix run once as a batch of one, its keys and values reused by every row,
    `models.prefix_cache`), the rows padded or (``packed``, as the trainer with ``trainer.packing``) padded or packed as a
    prefix tree after it, whichever `models.prefix_cache.cached_cost` finds cheaper. Returns the (B, T)
    log-probs of the ``mask`` positions and the tokens run."""
    from searchrl.models.policy import forward_lean
    from searchrl.models.prefix import attention_for, pack_shared
    from searchrl.models.prefix_cache import cached_cost, common_prefix

    n = common_prefix(ids, attn)
    p = pack_shared(ids, attn, mask) if packed else None
    if p is not None and n and cached_cost(*ids.shape, n) < cached_cost(*p.input_ids.shape, n):
        p = None  # as the trainer chooses (`engine.step`): padded after the prefix where that costs less
    if p is None:
        return forward_lean(model, ids, attn, mask, 1.0, prefix=n)[0], ids.numel() - (ids.shape[0] - 1) * n
    a = attention_for(p.attention, model.config._attn_implementation, model.dtype)
    lp = forward_lean(model, p.input_ids, a, p.loss_mask, 1.0, position_ids=p.position_ids, prefix=n)[0]
    return p.unpack(lp), p.input_ids.numel() - (p.input_ids.shape[0] - 1) * n


def block_mask(mask, kind, dtype):
    """The (R, 1, C, C) boolean tree mask as FlexAttention's block mask (blocks of 128 × 128 that no query
    sees are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, _, C, _ = mask.shape
    return create_block_mask(lambda b, h, q, kv: mask[b, 0, q, kv], R, None, C, C, device=str(mask.device))


def timed_passes(
    model, batches: list, mode: str, repeats: int, layout: list[float] | None = None
) -> tuple[list[float], int]:
    """Seconds of each round of forward + backward passes over ``batches`` ((ids, attention, loss mask) each),
    padded, packed, or packed with shared prefixes (``mode``: shared with the dense tree mask, flex with
    FlexAttention's block mask), or with the common prefix's keys and values reused (`cached_prefix_logprobs`:
    prefix_kv padded, shared_kv packed with shared prefixes), the first round a warm-up; and the tokens run.
    ``layout``: if given, each round's seconds spent building the packed layout and its attention mask are
    appended to it (the device synchronised around that part, which the plain timing does not do)."""
    import torch

    from searchrl.core.functional import masked_sum
    from searchrl.models.packing import pack
    from searchrl.models.policy import forward_lean
    from searchrl.models.prefix import attention_for, pack_shared

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    kind, to_kernel = model.config._attn_implementation, attention_for
    if mode == "flex":  # the dense tree mask as FlexAttention's block mask
        use_tree_attention(model)
        to_kernel = block_mask
    times, run_tokens = [], 0
    for _ in range(repeats + 1):  # the first round warms up
        t0, run_tokens, built = time.perf_counter(), 0, 0.0
        for ids, attn, mask in batches:
            if mode == "padded":
                lp, _, _ = forward_lean(model, ids, attn, mask, 1.0)
                m, run_tokens = mask, run_tokens + ids.numel()
            elif mode in ("prefix_kv", "shared_kv"):
                lp, ran = cached_prefix_logprobs(model, ids, attn, mask, packed=mode == "shared_kv")
                m, run_tokens = mask, run_tokens + ran
            else:
                if layout is not None:
                    sync()
                    t1 = time.perf_counter()
                p = pack_shared(ids, attn, mask) if mode in ("shared", "flex") else None
                p = p or pack(ids, attn, mask)
                a = None if p.attention is None else to_kernel(p.attention, kind, model.dtype)
                if layout is not None:
                    sync()
                    built += time.perf_counter() - t1
                lp, _, _ = forward_lean(model, p.input_ids, a, p.loss_mask, 1.0, position_ids=p.position_ids)
                m, run_tokens = p.loss_mask, run_tokens + p.input_ids.numel()
            masked_sum(lp, m).backward()
            model.zero_grad(set_to_none=True)
        sync()  # a GPU runs asynchronously: wait before reading the clock
        times.append(time.perf_counter() - t0)
        if layout is not None:
            layout.append(built)
    return times, run_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--episodes", required=True, help="a NAME.predictions.jsonl (its transcripts' lengths)")
    p.add_argument("--states", type=int, default=16, help="recorded states in the batch")
    p.add_argument("--k", type=int, default=5, help="candidates per state (SLATE's k)")
    p.add_argument("--micro", type=int, default=20, help="trainer.micro_batch_size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="quickstart")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    from packing import in_own_process  # benchmarks/packing.py, beside this script

    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(one(a.model, spec["rows"], a.micro, spec["mode"], a.repeats)))
        return
    rows = batch_of(a.model, a.episodes, a.states, a.k, a.seed)
    results = []
    for mode in MODES:
        r = in_own_process(__file__, a, json.dumps({"rows": rows, "mode": mode}))
        results.append(r)
        print(
            f"{mode:7s}: {r['tokens_per_s']:.0f} tok/s, {r['s_per_pass']:.2f} s/pass, {r['tokens_run']} tokens "
            f"run for {r['real_tokens']} real, peak RSS {r['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    summary = {"model": a.model, "states": a.states, "k": a.k, "micro": a.micro, "results": results}
    out_file = Path(a.out) / f"shared-prefix-{a.name}.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
