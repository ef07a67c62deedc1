"""Sequence packing for the trainer's passes: the real tokens of a right-padded micro-batch (B, T) are
placed into R ≤ B rows of C tokens (first-fit by decreasing length; C defaults to the longest sequence),
several sequences per row, with position ids restarting at 0 for each. transformers (5.x) reads such
position ids with no 2-D attention mask as packed sequences: a block-diagonal causal mask for the SDPA and
eager kernels, variable-length attention for flash-attention (`masking_utils.find_packed_sequence_indices`).
Outputs are scattered back to (B, T), so every loss, mask and aggregation downstream is unchanged.

Rows stay at most C long because SDPA and eager attention cost C² per row whatever the mask: one row of the
whole micro-batch (C = Σ lengths) would make attention quadratic in the micro-batch (measured 2.4-3.2×
slower on the quickstart, `benchmarks/results/packing-quickstart.json`). A row's unused tail is padding
that continues the last sequence's positions; nothing real attends to it.

Each token's log-prob is read from the previous position; at a sequence's first token that position is
the previous sequence's last, but a first token is always a prompt token and never carries loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # (R, C)
    position_ids: torch.Tensor  # (R, C), 0 … L_b − 1 per sequence
    loss_mask: torch.Tensor  # (R, C)
    index: torch.Tensor  # (N,) flat positions of the real tokens in (B · T)
    src: torch.Tensor  # (N,) their flat positions in (R · C)
    shape: tuple[int, int]  # (B, T)
    # (R, 1, C, C) boolean, True where a query may attend to a key: set by `models.prefix.pack_shared` (shared
    # contexts need a custom mask); None: transformers builds the block-diagonal mask from the positions
    attention: torch.Tensor | None = None

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(R, C) -> (B, T), 0 at padding."""
        out = torch.zeros(self.shape[0] * self.shape[1], dtype=x.dtype, device=x.device)
        return out.index_put((self.index,), x.reshape(-1)[self.src]).view(self.shape)


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row: first fit by decreasing length into rows of ``capacity`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[b] <= free:
                rows[r].append(b)
                room[r] -= lengths[b]
                break
        else:
            rows.append([b])
            room.append(capacity - lengths[b])
    return rows


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    capacity: int | None = None,
) -> Packed:
    """The right-padded rows' real tokens (``attention_mask`` (B, T) marks them), packed into rows of
    ``capacity`` tokens (default: the longest sequence)."""
    B, T = input_ids.shape
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("packing expects right-padded rows (a real token after padding)")
    lengths = [int(n) for n in real.sum(-1)]
    C = max(capacity or 0, max(lengths, default=1), 1)
    rows = first_fit(lengths, C)
    dev = input_ids.device
    ids = torch.zeros((len(rows), C), dtype=input_ids.dtype, device=dev)
    mask = torch.zeros((len(rows), C), dtype=loss_mask.dtype, device=dev)
    pos = torch.zeros((len(rows), C), dtype=torch.long, device=dev)
    index, src = [], []
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            n = lengths[b]
            ids[r, at : at + n] = input_ids[b, :n]
            mask[r, at : at + n] = loss_mask[b, :n]
            pos[r, at : at + n] = torch.arange(n, device=dev)
            index.append(torch.arange(b * T, b * T + n, device=dev))
            src.append(torch.arange(r * C + at, r * C + at + n, device=dev))
            at += n
        last = lengths[members[-1]]  # the tail continues the last sequence's positions
        pos[r, at:] = torch.arange(last, last + C - at, device=dev)
    return Packed(ids, pos, mask, torch.cat(index), torch.cat(src), (B, T))


def padding_fraction(attention_mask: torch.Tensor) -> float:
    """Padding tokens over all tokens of a (B, T) batch."""
    return 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)
