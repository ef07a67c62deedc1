"""Sequence packing for the trainer's passes: a right-padded micro-batch (B, T) becomes one row of its real
tokens (1, N), N = Σ lengths, with position ids restarting at 0 for each sequence. transformers (5.x) reads
such position ids with no 2-D attention mask as packed sequences: a block-diagonal causal mask for the SDPA
and eager kernels, variable-length attention for flash-attention (`masking_utils.find_packed_sequence_indices`).
Outputs are scattered back to (B, T), so every loss, mask and aggregation downstream is unchanged.

Each token's log-prob is read from the previous position; at a sequence's first token that position is
the previous sequence's last, but a first token is always a prompt token and never carries loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N), 0 … L_b − 1 per sequence
    loss_mask: torch.Tensor  # (1, N)
    index: torch.Tensor  # (N,) flat positions into (B · T)
    shape: tuple[int, int]  # (B, T)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N) -> (B, T), 0 at padding."""
        out = torch.zeros(self.shape[0] * self.shape[1], dtype=x.dtype, device=x.device)
        return out.index_put((self.index,), x[0]).view(self.shape)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> Packed:
    """The right-padded rows' real tokens, concatenated; ``attention_mask`` (B, T) marks them."""
    B, T = input_ids.shape
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("packing expects right-padded rows (a real token after padding)")
    index = real.view(-1).nonzero().squeeze(-1)
    lengths = real.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(int(lengths.sum()), device=input_ids.device) - torch.repeat_interleave(starts, lengths)
    return Packed(
        input_ids.reshape(-1)[index][None],
        pos[None],
        loss_mask.reshape(-1)[index][None],
        index,
        (B, T),
    )


def padding_fraction(attention_mask: torch.Tensor) -> float:
    """Padding tokens over all tokens of a (B, T) batch."""
    return 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)
