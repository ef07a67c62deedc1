"""Packing with shared prefixes: the rows of a micro-batch laid out as a prefix tree, so that every prefix
several rows share runs once in the forward and the backward: SLATE's and RAG-Gym's k candidates of one
step, a question's G episodes (their prompt), a system prompt with tool schemas that every row begins with,
and the turns that branches of one episode share (Tree-GRPO, ARPO).

Rows sorted by their tokens share with their predecessor the longest prefix they share with any earlier row
(L tokens). In one packed row, the first row is laid out whole and each next one adds a segment

    row 1 whole | token L₂−1 of row 2, rest of row 2 | token L₃−1 of row 3, rest of row 3 | …

with positions L−1, L, … for a segment, and a 4-D attention mask in which each segment sees its path's first
L − 1 tokens (where earlier rows put them) and itself, causally. The shared prefix's last token is repeated
at the head of every segment (one token per row) so that the segment's first own token is predicted from the
position just before it in the packed row, as everywhere else: the log-prob, entropy and value of every
original (row, position) are then read from one packed position, the shared ones where they were first
placed, so their gradients sum over the rows that share them; a head's repeat is never read. Results equal
the padded batch's (tests/models/test_packing.py). Which consecutive rows share one packed row is chosen to
minimise the cost of the packed rows' tokens and attention (∝ width², `_cost`, paid on every packed row's
whole width); where no layout that shares costs less than plain packing, the micro-batch is packed plainly.

The mask is custom, so sharing needs an attention kernel that takes one: SDPA (a boolean mask) or eager (an
additive one). With another (flash-attention's variable-length kernel), `prefix_mask_kind` is None and the
trainer packs without sharing (`models.packing`).
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


def _lcp(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the longest common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def _segments(order: list[int], lengths: list[int], lcps: list[int], cap: int) -> list[list[int]]:
    """Consecutive runs of the sorted rows, chosen by dynamic programming to minimise the summed `_cost` of their
    widths, none wider than ``cap`` but a single row (a run's width: its first member whole, then each next
    member from its shared prefix's last token on where it shares 2 or more tokens with the one before it, else
    whole)."""
    n = len(order)
    best = [0] + [None] * n  # best[i]: least cost of the first i sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        tail = 0  # the tokens rows order[i+1:j] add after their predecessors
        for i in range(j - 1, -1, -1):  # the run order[i:j]; its width grows as i moves left
            if i < j - 1:
                tail += _own(lengths[order[i + 1]], lcps[i + 1])
            width = lengths[order[i]] + tail
            if i < j - 1 and width > cap:
                break
            c = best[i] + _cost(width)  # type: ignore[operator]
            if best[j] is None or c < best[j]:  # type: ignore[operator]
                best[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return runs[::-1]


def _layout(
    order: list[int], lengths: list[int], lcps: list[int]
) -> tuple[list[list[list[int]]], int] | None:
    """The cheapest layout: packed rows (each a list of runs side by side) and their width, or None when the best
    shares nothing. Every packed row costs `_cost` of the common width (padding and attention are paid on the
    whole row), so run widths are capped at a few multiples of the longest row and the runs first-fitted into
    rows; plain packing (`models.packing`: one row per run of unrelated rows) is the layout to beat."""
    longest = max(lengths[b] for b in order)
    plain = len(first_fit([lengths[b] for b in order], longest)) * _cost(longest)
    best: tuple[int, list[list[list[int]]], int] | None = None
    lcp_of = dict(zip(order, lcps))  # row -> what it shares with the row before it in token order
    for cap in sorted({longest * k for k in (1, 2, 3, 4, 6, 8)} | {int(longest * 1.5)}):
        runs = _segments(order, lengths, lcps, cap)
        if all(all(lcp_of[b] < 2 for b in run[1:]) for run in runs):
            continue  # this cap shares nothing
        widths = [lengths[run[0]] + sum(_own(lengths[b], lcp_of[b]) for b in run[1:]) for run in runs]
        width = max(widths)
        bins = [[runs[i] for i in row] for row in first_fit(widths, width)]
        cost = len(bins) * _cost(width)
        if cost < plain and (best is None or cost < best[0]):
            best = (cost, bins, width)
    return None if best is None else (best[1], best[2])


def _own(length: int, lcp: int) -> int:
    """Tokens a row adds after the row before it: from its shared prefix's last token on, or all of it."""
    return length - lcp + 1 if lcp >= 2 else length


def pack_shared(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> Packed | None:
    """The right-padded micro-batch packed as a prefix tree with its 4-D mask (``Packed.attention``), or None
    when nothing is worth sharing (pack it with `models.packing.pack`).

    The rows are sorted by their tokens, so that each shares with the row before it the longest prefix it
    shares with any row before it (L tokens). The first row of a packed row is laid out whole; each next one
    adds only a segment: its L-th token again, then its own tokens, with positions L − 1, L, …, attending to its
    path's first L − 1 tokens where the rows before it put them and to its segment, causally. Every token of
    every row is read (log-prob, entropy, value) at one packed position whose predecessor in the row is its own
    predecessor in the sequence: the repeated token at a segment's head is never read, its predecessor being
    elsewhere; the shared positions are read where they were first placed, so their gradients sum over the
    rows that share them. A group's prompt, a system prompt that every row begins with, and the turns that
    branches of one episode share (Tree-GRPO, ARPO) each run once."""
    B, T = input_ids.shape
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("packing expects right-padded rows (a real token after padding)")
    lengths = [int(n) for n in real.sum(-1)]
    rows = [input_ids[b, : lengths[b]] for b in range(B)]
    order = sorted((b for b in range(B) if lengths[b]), key=lambda b: rows[b].tolist())  # empty rows: nothing
    if not order:
        return None
    lcps = [0] + [
        min(_lcp(rows[order[k - 1]], rows[order[k]]), lengths[order[k]] - 1) for k in range(1, len(order))
    ]
    lcp_of = dict(zip(order, lcps))
    layout = _layout(order, lengths, lcps)
    if layout is None:
        return None  # nothing worth sharing: plain packing
    bins, C = layout
    R, dev = len(bins), input_ids.device
    ids = torch.zeros((R, C), dtype=input_ids.dtype, device=dev)
    lmask = torch.zeros((R, C), dtype=loss_mask.dtype, device=dev)
    pos = torch.zeros((R, C), dtype=torch.long, device=dev)
    allow = torch.zeros((R, 1, C, C), dtype=torch.bool, device=dev)
    causal = torch.ones((C, C), dtype=torch.bool, device=dev).tril()
    read: dict[int, torch.Tensor] = {}  # row -> (length,) packed column of each of its positions
    for r, row in enumerate(bins):
        at = 0
        for b, prev in ((b, run[k - 1] if k else None) for run in row for k, b in enumerate(run)):
            n, lcp = lengths[b], lcp_of[b]
            share = lcp if prev is not None and lcp >= 2 else 0
            start = max(share - 1, 0)  # a shared row repeats its shared prefix's last token at its head
            m = n - start
            ids[r, at : at + m] = input_ids[b, start:n]
            lmask[r, at : at + m] = loss_mask[b, start:n]
            pos[r, at : at + m] = torch.arange(start, n, device=dev)
            allow[r, 0, at : at + m, at : at + m] = causal[:m, :m]
            cols = torch.arange(at, at + m, device=dev)
            if share:
                assert prev is not None
                allow[r, 0, at : at + m, read[prev][: share - 1]] = True  # its path's shared tokens
                cols = torch.cat([read[prev][:share], cols[1:]])  # the head's repeat is never read
            read[b] = cols
            at += m
        _pad_tail(allow, pos, r, at, C, int(pos[r, at - 1]) + 1)
    index = torch.cat([torch.arange(b * T, b * T + lengths[b], device=dev) for b in range(B)])
    src_by_row = {b: r * C + read[b] for r, row in enumerate(bins) for run in row for b in run}
    none = torch.zeros(0, dtype=torch.long, device=dev)
    src = torch.cat([src_by_row.get(b, none) for b in range(B)])
    out = Packed(ids, pos, lmask, index, src, (B, T))
    out.attention = allow
    return out


def _pad_tail(allow: torch.Tensor, pos: torch.Tensor, r: int, at: int, C: int, next_pos: int) -> None:
    """A row's unused tail: positions continue, each padding token attends to itself only (a query that
    attends to nothing would give NaN), and nothing real attends to it."""
    if at < C:
        pos[r, at:] = torch.arange(next_pos, next_pos + C - at, device=pos.device)
        k = torch.arange(at, C, device=pos.device)
        allow[r, 0, k, k] = True
