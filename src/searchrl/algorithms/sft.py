"""SFT: negative log-likelihood on the action tokens of given trajectories.

Observation and prompt tokens are context only. Used for the warm start from the synthetic world's
teacher, and by RAG-Gym's SFT on chosen actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from searchrl.algorithms.base import Algorithm, Requirements
from searchrl.algorithms.loss_terms import nll_loss
from searchrl.core.aggregate import Sum
from searchrl.core.config import AT_LEAST_0, AlgorithmSettings, check_ranges, setting
from searchrl.core.types import RolloutBatch, Segment, Step, Trajectory
from searchrl.rollout.loop import encode

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class SFTConfig(AlgorithmSettings):
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = setting(
        "token-mean", "how token losses become the batch's loss"
    )
    loss_on: Literal["actions", "all"] = setting(
        "actions",
        "actions: NLL on the agent's tokens only (RAG-Gym SFT, fine-tuning a pretrained model); all: language "
        "modelling on the whole trajectory, documents included, for a model trained from scratch (the local tiny "
        "models), whose documents repeat names and so teach it to copy them",
    )
    sampled_softmax: int = setting(
        0,
        "> 0: a sampled softmax (Jean et al., 2015) over the batch's tokens and this many sampled other rows "
        "(models.lean_head), for warm-starting a large vocabulary on a CPU; generation, RL and evaluation use the "
        "exact softmax. 0: exact",
        AT_LEAST_0,
    )

    def __post_init__(self) -> None:
        check_ranges(self)


def record_to_trajectory(
    rec: dict[str, Any], tokenizer: Any, example: Any = None, all_tokens: bool = False
) -> Trajectory:
    """A text record (prompt, actions, observations) as segments. These are dataset texts, not model
    samples, so tokenizing them here is right; each piece is tokenized on its own, as at rollout time.
    With ``all_tokens`` every piece is a target (segment kind "action"), for language-model training."""
    context = "action" if all_tokens else "observation"
    segs = [Segment("action" if all_tokens else "prompt", encode(tokenizer, rec["prompt"]))]
    steps = []
    n = len(segs[0].token_ids)
    for action, obs in zip(rec["actions"], rec["observations"]):
        segs.append(Segment("action", encode(tokenizer, action)))
        n += len(segs[-1].token_ids)
        steps.append(Step(segment=len(segs) - 1, last_token=n - 1, info=None))  # type: ignore[arg-type]
        if obs:
            segs.append(Segment(context, encode(tokenizer, obs)))  # type: ignore[arg-type]
            n += len(segs[-1].token_ids)
    return Trajectory(example=example, segments=segs, steps=steps, finish_reason=rec.get("finish_reason"))


class SFT(Algorithm):
    Config = SFTConfig

    @classmethod
    def requires(cls, config: SFTConfig, env: EnvConfig) -> Requirements:
        return Requirements(online=False, data="trajectories", old_logprobs=False)

    def __init__(self, config: SFTConfig, ctx: Any) -> None:
        super().__init__(config, ctx)
        if not ctx.records:
            raise ValueError("SFT needs training records (teacher trajectories or a dataset of them)")
        all_tokens = config.loss_on == "all"
        self.trajs = [record_to_trajectory(r, ctx.tokenizer, all_tokens=all_tokens) for r in ctx.records]

    def num_items(self) -> int:
        return len(self.trajs)

    @property
    def softmax_negatives(self) -> int:
        return int(self.cfg.sampled_softmax)

    def collect(self, indices: Sequence[int]) -> tuple[list[Trajectory], dict[str, float]]:
        picked = [self.trajs[i] for i in indices]
        tokens = sum(t.n_action_tokens for t in picked)
        return picked, {"sft/action_tokens": Sum(tokens)}

    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return nll_loss(logp)
