"""Step-level preference pairs (RAG-Gym §2.2): data and the placement of a pairwise loss.

A pair record (`process_data.step_pairs`) holds a state as text pieces and two candidate actions. Each
becomes two training rows — state as context, then the action, which alone carries loss — that sit next
to each other in every micro-batch (the trainer keeps pairs together for ``pairwise`` algorithms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from searchrl.algorithms.base import Algorithm, Requirements
from searchrl.algorithms.sft import record_to_trajectory
from searchrl.core.types import RolloutBatch, Segment, Step, Trajectory
from searchrl.rollout.loop import encode

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


def action_row(rec: dict[str, Any], action: str, tokenizer: Any, chosen: bool, pair: int) -> Trajectory:
    """The state (prompt, earlier actions and observations: context, no loss) then ``action``."""
    state = record_to_trajectory(
        {"prompt": rec["prompt"], "actions": rec["actions"], "observations": rec["observations"]}, tokenizer
    )
    prefix = [i for s in state.segments for i in s.token_ids]
    ids = encode(tokenizer, action)
    t = Trajectory(
        example=None,  # type: ignore[arg-type]
        segments=[Segment("prompt", prefix), Segment("action", ids)],
        group_id=pair,
        pair_id=pair,
        chosen=chosen,
    )
    t.steps = [Step(segment=1, last_token=len(prefix) + len(ids) - 1, info=None)]  # type: ignore[arg-type]
    return t


def pair_rows(records: list[dict[str, Any]], indices: list[int], tokenizer: Any) -> list[Trajectory]:
    """Chosen then rejected row of each pair, consecutive, sharing the pair's index as pair (and group) id."""
    out = []
    for i in indices:
        out += [
            action_row(records[i], records[i]["chosen"], tokenizer, True, i),
            action_row(records[i], records[i]["rejected"], tokenizer, False, i),
        ]
    return out


def pair_split(mb: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (chosen, rejected) of the micro-batch's pairs, matched by pair id; rows of no pair (the
    trainer's padding) are left out."""
    paired = mb.pair_ids >= 0
    c_idx, r_idx = (paired & mb.chosen).nonzero().squeeze(-1), (paired & ~mb.chosen).nonzero().squeeze(-1)
    c_idx = c_idx[mb.pair_ids[c_idx].argsort()]
    r_idx = r_idx[mb.pair_ids[r_idx].argsort()]
    if len(c_idx) != len(r_idx) or not torch.equal(mb.pair_ids[c_idx], mb.pair_ids[r_idx]):
        raise RuntimeError("a micro-batch holds an incomplete preference pair")
    return c_idx, r_idx


def place_pair_loss(
    pair_loss: torch.Tensor, c_idx: torch.Tensor, r_idx: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B, T) per-token loss with each pair's loss at the last action token of both its rows; aggregated
    with ``seq-mean-token-sum`` this is the mean pair loss over the global batch."""
    out = torch.zeros(mask.shape, dtype=pair_loss.dtype, device=mask.device)
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, -1).max(-1).values
    rows = torch.cat([c_idx, r_idx])
    return out.index_put((rows, last[rows]), torch.cat([pair_loss, pair_loss]))


class PairwiseAlgorithm(Algorithm):
    """Offline training on pair records (``ctx.records``): two rows per pair, kept in one micro-batch."""

    @classmethod
    def requires(cls, config: Any, env: EnvConfig) -> Requirements:
        return Requirements(samples_per_item=2, online=False, data="pairs", rows="pairs", old_logprobs=False)

    def __init__(self, config: Any, ctx: Any) -> None:
        super().__init__(config, ctx)
        self.records: list[dict[str, Any]] = list(ctx.records or [])
        if not self.records:
            raise ValueError(
                f"{type(self).__name__} needs preference pairs: set process_data.out to data from "
                "`searchrl collect-process-data`"
            )

    def num_items(self) -> int:
        return len(self.records)

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        return pair_rows(self.records, indices, self.ctx.tokenizer), {}
