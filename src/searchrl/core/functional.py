"""Pure tensor maths shared by every algorithm. Shapes: B sequences, T tokens, V vocabulary."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"]
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    total = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / total.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance over the masked entries; ``unbiased`` divides by n − 1 (Bessel), as verl and TRL whiten."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, unbiased: bool = True
) -> torch.Tensor:
    """(x - mean) / std over the masked entries; entries outside the mask are returned as 0. The std is
    the unbiased one by default, as in verl (Search-R1's PPO) and TRL."""
    mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def _row_chunks(logits: torch.Tensor, max_elements: int = 1 << 27) -> int:
    """Rows per chunk so one chunk's float32 (rows, T, V) stays under ``max_elements`` (512 MB)."""
    per_row = logits.shape[1] * logits.shape[2]
    return max(1, max_elements // max(per_row, 1))


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(input_ids[t] | input_ids[<t]) aligned with input positions: (B, T), 0 at t = 0.

    ``logits`` (B, T, V) are the model outputs for the same ``input_ids``. With ``mask`` (B, T), only the
    masked positions are computed (the rest are 0): the log-softmax over the vocabulary then costs only
    the action tokens. Without it, rows are processed in chunks (split, whose backward concatenates rather
    than zero-filling a full gradient per row) so a float32 (B, T, V) tensor is never built at once.
    """
    if mask is not None:
        pos = mask[:, 1:].bool()
        lg = logits[:, :-1][pos].float()  # (N, V)
        if temperature != 1.0:
            lg = lg / temperature
        vals = torch.gather(lg, -1, input_ids[:, 1:][pos][:, None]).squeeze(-1) - torch.logsumexp(lg, -1)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
        return out.masked_scatter(F.pad(pos, (1, 0)), vals)
    rows = _row_chunks(logits)
    outs = []
    for lg, ids in zip(logits.split(rows), input_ids.split(rows)):
        lg = lg[:, :-1].float()
        if temperature != 1.0:
            lg = lg / temperature
        picked = torch.gather(lg, -1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(lg, -1)
        outs.append(F.pad(picked, (1, 0)))
    return torch.cat(outs)


def token_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at the masked positions, aligned like `token_logprobs`."""
    pos = mask[:, 1:].bool()
    lp = F.log_softmax(logits[:, :-1][pos].float(), -1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(F.pad(pos, (1, 0)), -(lp.exp() * lp).sum(-1))


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimators of KL(π || π_ref) from samples of π (Schulman, 2020).

    k1 = log r', k2 = ½ (log r')², k3 = r - 1 - log r with r = π_ref / π and log r' = log π - log π_ref.
    k3 is unbiased and non-negative (GRPO / ReSearch use it in the loss). The exponent of k3 is held to
    ±20 so it cannot overflow. ``clamp`` bounds the estimate to [−clamp, clamp] (verl clamps k3 to ±10:
    at log r' = 5 the estimate 142.4 becomes 10); None, the default, leaves it as the equation writes it.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio**2
    elif kind == "k3":
        lr = (-log_ratio).clamp(-20.0, 20.0)
        kl = torch.exp(lr) - 1.0 - lr
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: k1, k2, k3")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def token_weights(
    mask: torch.Tensor, mode: str, global_tokens: float, global_seqs: float, norm_len: float | None = None
) -> torch.Tensor:
    """Per-token weights w so that loss = Σ w · ℓ aggregates over the *global* batch (docs/design.md §4.5).

    ``global_tokens``/``global_seqs`` count the mask tokens / sequences across every micro-batch and process
    of the optimizer step, so the result does not depend on how the batch is split.
    - token-mean: Σ ℓ / N_tokens (DAPO-style)
    - seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO)
    - seq-mean-token-sum: mean over sequences of each sequence's token sum
    - token-sum-norm: Σ ℓ / (N_seqs · norm_len) with a constant length (Dr. GRPO)
    """
    if mode == "token-mean":
        return mask / max(global_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(global_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return mask / max(global_seqs, 1.0)
    if mode == "token-sum-norm":
        if not norm_len:
            raise ValueError("token-sum-norm needs norm_len (the maximum response length)")
        return mask / (max(global_seqs, 1.0) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGS)}")
