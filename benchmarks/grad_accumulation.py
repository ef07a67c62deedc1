"""Gradient accumulation across micro-batches for a bfloat16 policy: in place in bfloat16 (autograd's default,
and ``trainer.master_weights: false``) against float32 sums rounded once (`engine.precision.Float32Gradients`,
with master weights), both measured against the exact sum of the same micro-batch gradients. Folded two ways: in one process (the total rounded once) and as under
DDP (the sums rounded before the last pass, which adds its gradient in bfloat16 and reduces).

    python benchmarks/grad_accumulation.py [--size tiny] [--micro 2 8 32] [--rows 4] [--tokens 128]
    python benchmarks/grad_accumulation.py --size qwen2.5-0.5b --layers 2 --micro 2 8 16 --rows 2 --out ...

A random-weight Qwen2-architecture model of ``--size`` (`searchrl.models.tiny`), bfloat16, next-token loss on
random token ids, divided by the number of micro-batches as the trainer's global normalisation does. Each
micro-batch's own gradient is computed alone first (bfloat16, as autograd produces it); the reference is their
sum in float64. Then the same micro-batches run as an update does: N backward passes into the same
gradients, in place or folded. Reported: the relative L2 error of the accumulated gradient, and the share of
its elements that differ from the reference rounded to bfloat16; the floor is the reference's own rounding
to bfloat16 (``rounded_exact_rel_error``). Writes
benchmarks/results/grad_accumulation.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from searchrl.engine.precision import Float32Gradients
from searchrl.models.tiny import SIZES

REPO = Path(__file__).resolve().parents[1]
MODES = ("in_place", "one_process", "ddp")


def loss_of(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / n


def accumulate(model: torch.nn.Module, batches: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """The gradients after N backward passes, as an update runs them: ``in_place``, or folded as in
    ``one_process`` or under ``ddp`` (where the last pass gets the sums, to reduce them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    g32 = None if mode == "in_place" else Float32Gradients(params, distributed=mode == "ddp")
    try:
        for i, ids in enumerate(batches):
            last = i == len(batches) - 1
            if g32 is not None:
                g32.before_backward(last)
            loss_of(model, ids, len(batches)).backward()
            if g32 is not None:
                g32.after_backward(last)
    finally:
        if g32 is not None:
            g32.remove()
    return [p.grad.detach().clone() for p in params]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--layers", type=int, default=None, help="keep only this many layers of the shape")
    p.add_argument("--micro", type=int, nargs="+", default=[2, 8, 32], help="micro-batches per update")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--tokens", type=int, default=128, help="tokens per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grad_accumulation.json"))
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = SIZES[args.size]
    cfg = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=args.layers or spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    params = [q for q in model.parameters() if q.requires_grad]
    rows = []
    for n in args.micro:
        gen = torch.Generator().manual_seed(args.seed + n)
        batches = [torch.randint(cfg.vocab_size, (args.rows, args.tokens), generator=gen) for _ in range(n)]
        t0 = time.perf_counter()
        exact = [torch.zeros(q.shape, dtype=torch.float64) for q in params]
        for ids in batches:  # each micro-batch's own bfloat16 gradient, summed exactly
            model.zero_grad(set_to_none=True)
            loss_of(model, ids, n).backward()
            for e, q in zip(exact, params):
                e += q.grad.double()
        row: dict[str, float | int] = {"micro_batches": n}
        ref_norm = torch.sqrt(sum((e**2).sum() for e in exact))
        # the floor: the exact sum itself, rounded once to bfloat16
        floor = torch.sqrt(sum(((e.to(torch.bfloat16).double() - e) ** 2).sum() for e in exact))
        row["rounded_exact_rel_error"] = float(floor / ref_norm)
        for name in MODES:
            grads = accumulate(model, batches, name)
            err = torch.sqrt(sum(((g.double() - e) ** 2).sum() for g, e in zip(grads, exact)))
            differ = sum(int((g != e.to(torch.bfloat16)).sum()) for g, e in zip(grads, exact))
            row[f"{name}_rel_error"] = float(err / ref_norm)
            row[f"{name}_elements_off"] = differ / sum(q.numel() for q in params)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"{n:>3} micro-batches, relative error (share of elements off the rounded sum): "
            + ", ".join(f"{m} {row[f'{m}_rel_error']:.2e} ({row[f'{m}_elements_off']:.1%})" for m in MODES)
            + f"; the exact sum rounded once {row['rounded_exact_rel_error']:.2e}"
        )
    result = {
        "size": args.size,
        "layers": cfg.num_hidden_layers,
        "parameters": sum(q.numel() for q in params),
        "rows": args.rows,
        "tokens": args.tokens,
        "seed": args.seed,
        "torch": torch.__version__,
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
