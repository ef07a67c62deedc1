"""What an algorithm is: how it collects, how it turns rewards into advantages, and its loss.

The trainer owns everything else (rollout machinery, masking, logprob passes, aggregation, optimisation,
checkpoints), so each algorithm module reads top to bottom in a page.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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
    sum_all: Callable[[Any], float] = float  # sums a number over processes (batch statistics must be global)


class Algorithm(ABC):
    Config: ClassVar[type]
    online: ClassVar[bool] = True  # collects with the rollout loop (False: trains on given records)
    needs_old_logprobs: ClassVar[bool] = True
    value_head: ClassVar[bool] = False  # actor-critic: the policy carries a value head (`PolicyWithValue`)
    needs_process_reward: ClassVar[bool] = False  # the experiment must configure a per-step reward
    pairwise: ClassVar[bool] = False  # rows come in (chosen, rejected) pairs that share a micro-batch
    policy: ClassVar[bool] = True  # the trained model acts (False: a scorer, evaluated guiding a policy)
    data: ClassVar[str | None] = None  # offline data: "trajectories" (SFT records) or "pairs" (process data)

    def __init__(self, config: Any, ctx: Context) -> None:
        self.cfg, self.ctx = config, ctx
        self.step = 0  # the trainer sets the current step before each collect

    @classmethod
    def samples_per_item(cls, config: Any, exp: Any) -> int:
        """Training sequences one item (question, record) yields per step, the same on every process."""
        return int(exp.rollout.group_size) if cls.online else 1

    @classmethod
    def param_groups(cls, config: Any, model: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups (e.g. a critic learning rate for the value head)."""
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state that must survive a resume (e.g. an adaptive KL coefficient); JSON-serialisable."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what `state_dict` returned."""

    # how many items (questions, records) one pass over the training data has
    def num_items(self) -> int:
        return len(self.ctx.train_examples)

    @property
    def kl_coef(self) -> float:
        return float(getattr(self.cfg, "kl_coef", 0.0))

    @property
    def softmax_negatives(self) -> int:
        """> 0: the training pass uses a sampled softmax with this many negatives (SFT warm starts only)."""
        return 0

    @property
    def loss_agg(self) -> str:
        return str(getattr(self.cfg, "loss_agg", "token-mean"))

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories (with rewards) for the training items ``indices`` of this process: by default
        ``rollout.group_size`` fresh episodes per question, scored by the reward pipeline."""
        from searchrl.rollout.loop import rollout

        c = self.ctx
        examples = [c.train_examples[i] for i in indices]
        trajs, stats = rollout(
            examples, c.env, c.generator, c.tokenizer, c.sampling, c.group_size, c.max_total_tokens
        )
        for t in trajs:  # group ids unique across processes: one group per question
            t.group_id = indices[t.group_id]
        return trajs, {**stats.metrics(), **c.rewards(trajs)}

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """Fill ``batch.extras`` (advantages, returns, …) from rewards and the no-grad passes."""
        return {}

    def kl_estimate(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """Per-token KL(π‖π_ref) with the config's ``kl_estimator`` and optional ``kl_clamp``."""
        from searchrl.functional import kl_penalty

        return kl_penalty(logp, ref_logp, self.cfg.kl_estimator, getattr(self.cfg, "kl_clamp", None))

    def with_kl(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Adds β·KL(π‖π_ref) per action token when the config puts the KL in the loss (``kl_in: loss``,
        estimator ``kl_estimator``), and logs the entropy."""
        if getattr(self.cfg, "kl_in", "loss") == "loss" and self.kl_coef > 0:
            kl = self.kl_estimate(logp, mb.extras["ref_logp"])
            loss = loss + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        if entropy is not None:
            metrics["entropy"] = entropy
        return loss, metrics

    @abstractmethod
    def loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Unreduced per-token loss (B, T) and per-token metrics for a micro-batch; ``values`` (B, T) from
        the value head when the algorithm has one."""


def head_param_groups(model: torch.nn.Module, lr: float, head_lr: float) -> list[dict[str, Any]]:
    """Two optimizer groups: the value / scoring head at ``head_lr``, everything else trainable at ``lr``."""
    head = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("value_head.")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("value_head.")]
    return [{"params": rest, "lr": lr}, {"params": head, "lr": head_lr}]
