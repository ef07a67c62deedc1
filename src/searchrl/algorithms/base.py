"""What an algorithm is: how it collects, how it turns rewards into advantages, and its loss.

The trainer owns everything else (rollout machinery, masking, logprob passes, aggregation, optimisation,
checkpoints), so each algorithm module reads top to bottom in a page.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from searchrl.types import RolloutBatch, Trajectory


@dataclass
class Context:
    """What the trainer hands an algorithm: the environment, a generator, the tokenizer, rewards."""

    env: Any
    generator: Any
    tokenizer: Any
    rewards: Any  # RewardPipeline | None
    sampling: Any  # SamplingParams
    group_size: int
    max_total_tokens: int
    train_examples: list[Any]
    records: list[Any] | None = None  # offline data (SFT records), when the algorithm trains on a dataset


class Algorithm(ABC):
    Config: ClassVar[type]
    online: ClassVar[bool] = True  # collects with the rollout loop (False: trains on given records)
    needs_old_logprobs: ClassVar[bool] = True

    def __init__(self, config: Any, ctx: Context) -> None:
        self.cfg, self.ctx = config, ctx

    # how many items (questions, records) one pass over the training data has
    def num_items(self) -> int:
        return len(self.ctx.train_examples)

    @property
    def kl_coef(self) -> float:
        return float(getattr(self.cfg, "kl_coef", 0.0))

    @property
    def loss_agg(self) -> str:
        return str(getattr(self.cfg, "loss_agg", "token-mean"))

    @abstractmethod
    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories (with rewards) for the training items ``indices`` of this process."""

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """Fill ``batch.extras`` (advantages, returns, …) from rewards and the no-grad passes."""
        return {}

    @abstractmethod
    def loss(self, logp: torch.Tensor, entropy: torch.Tensor | None, mb: RolloutBatch
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """Unreduced per-token loss (B, T) and per-token metrics for a micro-batch."""
