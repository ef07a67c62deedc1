"""A process reward model as in RAG-Gym (§2.2.2, eq. 7): a scalar head on a causal LM scores a
(state, action) pair, trained on step-level preference pairs with

    L = −log σ( r(s, a⁺) − r(s, a⁻) ).

r(s, a) is the head on the hidden state of the action's last token. The model (LM + head,
`models.policy.PolicyWithValue`) is saved as a model of its own; `rewards.prm_scorer` loads it to score
actions, as a reward for the online algorithms and for PRM-guided best-of-N inference (Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from searchrl.algorithms.base import Requirements, head_param_groups
from searchrl.algorithms.preference import PairwiseAlgorithm, pair_split, place_pair_loss
from searchrl.core.config import POSITIVE, AlgorithmSettings, check_ranges, setting
from searchrl.core.types import RolloutBatch, Segment, Trajectory

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class PRMConfig(AlgorithmSettings):
    head_lr: float | None = setting(None, "the scoring head's learning rate; null: 10 × trainer.lr", POSITIVE)
    loss_agg: Literal["seq-mean-token-sum"] = setting("seq-mean-token-sum", "the pair loss is placed per row")

    def __post_init__(self) -> None:
        check_ranges(self)


def prm_loss(score_c: torch.Tensor, score_r: torch.Tensor) -> torch.Tensor:
    """Eq. 7 per pair."""
    return -F.logsigmoid(score_c - score_r)


class PRM(PairwiseAlgorithm):
    Config = PRMConfig

    @classmethod
    def requires(cls, config: PRMConfig, env: EnvConfig) -> Requirements:
        # a scorer, not a policy: evaluated as best-of-N guidance of the policy it started from
        return replace(super().requires(config, env), value_head=True, acts=False)

    @classmethod
    def param_groups(cls, config: Any, model: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
        return head_param_groups(model, lr, config.head_lr or 10 * lr)

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        rows, _ = super().collect(indices)
        eos = self.ctx.tokenizer.eos_token_id
        for t in rows:  # one token after the action: the value read there is the head on its last token
            t.segments.append(Segment("observation", [eos]))
        return rows, {}

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if values is None:
            raise RuntimeError("the PRM needs the scoring head's outputs; the trainer passes them")
        c, r = pair_split(mb)
        score = values.gather(1, (mb.step_ends[:, 0] + 1)[:, None]).squeeze(1)  # r(s, a) per row
        loss = prm_loss(score[c], score[r])
        placed = place_pair_loss(loss, c, r, mb.loss_mask)
        gap = (score[c] - score[r]).detach()
        return placed, {
            "prm_margin": place_pair_loss(gap, c, r, mb.loss_mask),
            "prm_accuracy": place_pair_loss((gap > 0).float(), c, r, mb.loss_mask),
        }
