"""Packing with shared prefixes: rows of a micro-batch whose context is the same token sequence (SLATE's
and RAG-Gym's k candidates of one step, a question's G episodes) run that context once.

A row's context is everything before its first loss token (SLATE's candidates: the whole recorded state).
Rows with the same context of P tokens are laid out in one packed row as

    context[0 .. P-2] | context[P-1], rest of candidate 1 | context[P-1], rest of candidate 2 | …

with positions 0 … P-2, then P-1, P, … again for every candidate, and a 4-D attention mask in which the
shared part is causal and each candidate's segment sees the shared part and itself, causally. The context's
last token is repeated at the head of every segment (one token per candidate) so that each segment's first
loss token is predicted from the position just before it in the row, as everywhere else: the log-prob,
entropy and value of every original (row, position) are then read from one packed position, and the
context's positions are read, and their gradients summed, from the shared ones. Results equal the padded
batch's (tests/models/test_packing.py). Rows that share nothing, or for which sharing costs more (the
attention of one long row grows with its square), are packed as in `models.packing`, their blocks causal
in the same mask.

The mask is custom, so sharing needs an attention kernel that takes one: SDPA (a boolean mask) or eager (an
additive one). With another (flash-attention's variable-length kernel), `prefix_mask_kind` is None and the
trainer packs without sharing.
"""

from __future__ import annotations

from typing import Any

import torch

from searchrl.models.packing import Packed, first_fit


def prefix_mask_kind(model: Any) -> str | None:
    """ "sdpa" or "eager": the attention kernel of ``model`` (under its wrappers) takes a custom 4-D mask."""
    for _ in range(8):
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            impl = config._attn_implementation
            return impl if impl in ("sdpa", "eager") else None
        inner = (
            getattr(model, "module", None) or getattr(model, "lm", None) or getattr(model, "base_model", None)
        )
        if inner is None or inner is model:
            return None
        model = inner
    return None


def attention_for(mask: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The (R, 1, C, C) boolean mask (True: may attend) as ``kind``'s kernel takes it."""
    if kind == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _cost(n: int) -> int:
    """Relative cost of a row of ``n`` tokens: its tokens plus its attention (∝ n²) at a 1,024-token scale."""
    return n + n * n // 1024


def _chunks(members: list[int], lengths: list[int], p: int) -> list[list[int]]:
    """The members of one context group in chunks of the size that costs least (size 1: not shared)."""
    best: tuple[int, int] | None = None
    for m in range(1, len(members) + 1):
        parts = [members[i : i + m] for i in range(0, len(members), m)]
        cost = sum(
            _cost(lengths[c[0]]) if len(c) == 1 else _cost(p - 1 + sum(lengths[b] - p + 1 for b in c))
            for c in parts
        )
        if best is None or cost < best[0]:
            best = (cost, m)
    assert best is not None
    m = best[1]
    return [members[i : i + m] for i in range(0, len(members), m)]


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> Packed | None:
    """The right-padded micro-batch packed with shared contexts and its 4-D mask (``Packed.attention``); None
    when no context is worth sharing (pack it with `models.packing.pack`)."""
    B, T = input_ids.shape
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("packing expects right-padded rows (a real token after padding)")
    lengths = [int(n) for n in real.sum(-1)]
    firsts = []
    for b in range(B):
        hits = loss_mask[b, : lengths[b]].nonzero()
        firsts.append(int(hits[0]) if len(hits) else lengths[b])
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(B):
        if 2 <= firsts[b] < lengths[b]:  # a context of 2 or more tokens, then something to train on
            groups.setdefault(tuple(input_ids[b, : firsts[b]].tolist()), []).append(b)
    shared = [
        (len(key), c)
        for key, members in groups.items()
        for c in _chunks(members, lengths, len(key))
        if len(c) > 1
    ]
    if not shared:
        return None
    done = {b for _, c in shared for b in c}
    rest = [b for b in range(B) if b not in done]
    capacity = max([lengths[b] for b in rest], default=1)
    plain = [[rest[i] for i in row] for row in first_fit([lengths[b] for b in rest], capacity)]
    widths = [p - 1 + sum(lengths[b] - p + 1 for b in c) for p, c in shared] + [capacity] * len(plain)
    R, C, dev = len(widths), max(widths), input_ids.device
    ids = torch.zeros((R, C), dtype=input_ids.dtype, device=dev)
    lmask = torch.zeros((R, C), dtype=loss_mask.dtype, device=dev)
    pos = torch.zeros((R, C), dtype=torch.long, device=dev)
    allow = torch.zeros((R, 1, C, C), dtype=torch.bool, device=dev)
    index: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    causal = torch.ones((C, C), dtype=torch.bool, device=dev).tril()

    def place(r: int, at: int, b: int, start: int, end: int, first_pos: int) -> None:
        """Tokens start … end-1 of row b at packed positions at … of row r; sets ids, loss, positions, map."""
        n = end - start
        ids[r, at : at + n] = input_ids[b, start:end]
        lmask[r, at : at + n] = loss_mask[b, start:end]
        pos[r, at : at + n] = torch.arange(first_pos, first_pos + n, device=dev)
        index.append(torch.arange(b * T + start, b * T + end, device=dev))
        src.append(torch.arange(r * C + at, r * C + at + n, device=dev))

    for r, (p, members) in enumerate(shared):
        head = members[0]
        place(r, 0, head, 0, p - 1, 0)  # the shared context but its last token, read by every member
        allow[r, 0, : p - 1, : p - 1] = causal[: p - 1, : p - 1]
        for b in members[1:]:
            index.append(torch.arange(b * T, b * T + p - 1, device=dev))
            src.append(torch.arange(r * C, r * C + p - 1, device=dev))
        at = p - 1
        for b in members:
            n = lengths[b] - p + 1
            place(r, at, b, p - 1, lengths[b], p - 1)
            allow[r, 0, at : at + n, : p - 1] = True
            allow[r, 0, at : at + n, at : at + n] = causal[:n, :n]
            at += n
        _pad_tail(allow, pos, r, at, C, int(pos[r, at - 1]) + 1)
    for r, members in enumerate(plain, start=len(shared)):
        at = 0
        for b in members:
            n = lengths[b]
            place(r, at, b, 0, n, 0)
            allow[r, 0, at : at + n, at : at + n] = causal[:n, :n]
            at += n
        _pad_tail(allow, pos, r, at, C, lengths[members[-1]])
    out = Packed(ids, pos, lmask, torch.cat(index), torch.cat(src), (B, T))
    out.attention = allow
    return out


def _pad_tail(allow: torch.Tensor, pos: torch.Tensor, r: int, at: int, C: int, next_pos: int) -> None:
    """A row's unused tail: positions continue, each padding token attends to itself only (a query that
    attends to nothing would give NaN), and nothing real attends to it."""
    if at < C:
        pos[r, at:] = torch.arange(next_pos, next_pos + C - at, device=pos.device)
        k = torch.arange(at, C, device=pos.device)
        allow[r, 0, k, k] = True
