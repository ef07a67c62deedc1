"""What an algorithm is: how it collects, how it turns rewards into advantages, and its loss.

The trainer owns everything else (rollout machinery, masking, logprob passes, aggregation, optimisation,
checkpoints), so each algorithm module reads top to bottom in a page.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from searchrl.core.config import AlgorithmSettings
from searchrl.core.types import RolloutBatch, Trajectory

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig
    from searchrl.core.records import Example
    from searchrl.envs.search import SearchEnv
    from searchrl.rewards.pipeline import RewardPipeline
    from searchrl.rollout.generator import Generator, SamplingParams


@dataclass(frozen=True)
class Requirements:
    """What an algorithm needs from the trainer, for one configuration. The trainer reads it before it
    builds anything: batch shapes, which models and passes to set up, where the training rows come from."""

    samples_per_item: int = 1  # training rows one item (question, record) yields per step, on every process
    online: bool = True  # collects with the rollout loop (False: trains on given records)
    data: Literal["trajectories", "pairs"] | None = None  # offline data: SFT records or preference pairs
    rows: Literal["single", "pairs"] = "single"  # "pairs": (chosen, rejected) rows that share a micro-batch
    old_logprobs: bool = True  # the loss uses π_old, the policy that sampled (the clipped ratio)
    # π_old is read before the updates too (a KL penalty in the reward); with a value head, old values are
    # always read then (GAE). Otherwise, when a rollout batch gets exactly one optimizer update, π_old is the
    # policy being updated and the trainer takes its log-probs from the update's own forward, detached,
    # instead of a separate no-grad pass (as TRL does with num_iterations=1)
    old_in_prepare: bool = False
    reference: bool = False  # a frozen reference model (a KL term, or DPO's implicit reward)
    value_head: bool = False  # a scalar head on the policy (`PolicyWithValue`): PPO's critic, the PRM
    detach_value_trunk: bool = False  # the value loss trains the head only
    process_reward: bool = False  # the experiment must configure a per-step reward
    acts: bool = True  # the trained model acts (False: a scorer, evaluated guiding a policy)
    # the algorithm scores teacher-forced continuations with the policy before its advantages (`Algorithm.probes`;
    # IGPO's answer probes): the trainer runs them in its no-grad pass and puts their mean log-probs in
    # ``batch.extras.more[PROBE_KEY]`` (B, S), by row and step slot
    probes: bool = False
    # the loss reads the policy's token entropy (AEPO's entropy-aware advantage): the update's forward computes
    # it even with ``trainer.log_entropy`` off
    entropy: bool = False

    def __post_init__(self) -> None:
        if self.samples_per_item < 1:
            raise ValueError(f"samples_per_item must be at least 1, not {self.samples_per_item}")
        if self.rows == "pairs" and self.samples_per_item % 2:
            raise ValueError("pair rows come two per item")
        if not self.online and self.data is None:
            raise ValueError("an offline algorithm names the data it trains on")


PROBE_KEY = (
    "probe_logp"  # batch.extras.more: (B, S) each probe's mean log-prob by row and step slot, NaN where none
)


@dataclass(frozen=True)
class Probe:
    """A teacher-forced continuation the trainer scores with the policy before the update: the mean log-prob
    of ``ids[start:end]`` given what precedes it, filed under (``row``, ``slot``) of the step's batch."""

    row: int
    slot: int  # the step slot (`RolloutBatch.step_ends`) the probe belongs to
    ids: list[int]
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 < self.start < self.end <= len(self.ids):
            raise ValueError(f"a probe scores a non-empty span after its context: [{self.start}, {self.end})")


@dataclass
class Context:
    """What the trainer hands an algorithm: the environment, a generator, the tokenizer, rewards."""

    env: SearchEnv
    generator: Generator | None  # None for offline algorithms
    tokenizer: Any  # a transformers tokenizer
    rewards: RewardPipeline | None
    sampling: SamplingParams
    max_total_tokens: int
    train_examples: list[Example]
    records: list[dict[str, Any]] | None = None  # offline data (SFT records, pairs)
    sum_all: Callable[[Any], float] = float  # sums a number over processes (batch statistics must be global)


class Algorithm(ABC):
    Config: ClassVar[type[AlgorithmSettings]]  # its keys, typed (docs/design.md, 'An algorithm')
    # its training rows are whole episodes of the rollout loop, G per question (an asynchronous rollout
    # worker can then collect them ahead of the trainer); False: it builds them itself (SLATE's step search)
    episodic: ClassVar[bool] = True

    def __init__(self, config: Any, ctx: Context) -> None:
        self.cfg, self.ctx = config, ctx
        self.step = 0  # the trainer sets the current step before each collect

    @classmethod
    @abstractmethod
    def requires(cls, config: Any, env: EnvConfig) -> Requirements:
        """What this algorithm, so configured, needs from the trainer (``env``: the experiment's)."""

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
        """β of the KL term to the reference model the algorithm adds (0: none)."""
        return 0.0

    @property
    def softmax_negatives(self) -> int:
        """> 0: the training pass uses a sampled softmax with this many negatives (SFT warm starts only)."""
        return 0

    @property
    def loss_agg(self) -> str:
        return str(self.cfg.loss_agg)

    def collect(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories (with rewards) for the training items ``indices`` of this process: by default
        ``group_size`` (the algorithm's config) fresh episodes per question, scored by the reward pipeline,
        then `finish`ed."""
        return self.finish(*self.episodes(indices))

    def finish(
        self, trajs: list[Trajectory], metrics: dict[str, float]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """What every scored batch of episodes goes through before training, whether collected here or taken
        from the asynchronous rollout worker (`engine.rollouts`): the algorithm's own post-processing (masks,
        truncation, unfolding) and its metrics. Nothing by default."""
        return trajs, metrics

    def accept(
        self, trajs: list[Trajectory], metrics: dict[str, float]
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Episodes collected elsewhere (the asynchronous rollout worker's, unscored, with its rollout metrics):
        scored by the reward pipeline, then `finish`ed: the post-processing `collect` gives the episodes it
        collects itself (`episodes`), so a batch trains the same whichever path it took."""
        if self.ctx.rewards is None:
            raise RuntimeError(
                f"{type(self).__name__} scores episodes: the trainer gives it a reward pipeline"
            )
        return self.finish(trajs, {**metrics, **self.ctx.rewards(trajs)})

    def episodes(self, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """``group_size`` fresh episodes per question of ``indices``, scored by the reward pipeline."""
        from searchrl.rollout.loop import rollout

        c = self.ctx
        if c.generator is None or c.rewards is None:
            raise RuntimeError(f"{type(self).__name__} collects episodes: the trainer gives it a generator")
        examples = [c.train_examples[i] for i in indices]
        trajs, stats = rollout(
            examples, c.env, c.generator, c.tokenizer, c.sampling, self.cfg.group_size, c.max_total_tokens
        )
        for t in trajs:  # group ids unique across processes: one group per question
            t.group_id = indices[t.group_id]
        return trajs, {**stats.metrics(), **c.rewards(trajs)}

    def probes(self, trajs: list[Trajectory], batch: RolloutBatch) -> list[Probe]:
        """The continuations the trainer scores before `prepare` when the requirements ask (``probes``)."""
        return []

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """Fill ``batch.extras`` (advantages, returns, …) from rewards and the no-grad passes."""
        return {}

    def kl_estimate(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """Per-token KL(π‖π_ref) with the config's ``kl_estimator`` and optional ``kl_clamp``."""
        from searchrl.core.functional import kl_penalty

        return kl_penalty(logp, ref_logp, self.cfg.kl_estimator, self.cfg.kl_clamp)

    def kl_weight(self, batch: RolloutBatch) -> torch.Tensor | None:
        """The weight (B, T) on each token's KL estimate to the reference: the sampler-trainer correction's w
        (``rollout_correction.weight_kl``, `algorithms.correction`: the estimators are expectations under
        π_θ, the tokens came from the sampler), or None where no correction weighs the batch."""
        corr = getattr(self.cfg, "rollout_correction", None)
        if corr is None or not corr.weight_kl:
            return None
        w: torch.Tensor | None = batch.extras.is_weight
        return None if w is None else w.detach()

    def with_kl(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: RolloutBatch,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Adds β·KL(π‖π_ref) per action token when the config puts the KL in the loss (``kl_in: loss``,
        estimator ``kl_estimator``), weighted by the sampler-trainer correction's w where it applies
        (`kl_weight`), and logs the entropy."""
        if self.cfg.kl_in == "loss" and self.kl_coef > 0:
            kl = self.kl_estimate(logp, mb.extras.need("ref_logp"))
            w = self.kl_weight(mb)
            if w is not None:
                metrics["kl_unweighted"] = kl.detach()
                kl = kl * w
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


def check_group_size(group_size: int) -> None:
    """``group_size`` (samples per question) of the online algorithms' configs."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, not {group_size}")


def head_param_groups(model: torch.nn.Module, lr: float, head_lr: float) -> list[dict[str, Any]]:
    """Two optimizer groups: the value / scoring head at ``head_lr``, everything else trainable at ``lr``."""
    head = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("value_head.")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("value_head.")]
    return [{"params": rest, "lr": lr}, {"params": head, "lr": head_lr}]
