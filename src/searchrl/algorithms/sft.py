"""SFT: negative log-likelihood on the action tokens of given trajectories.

Observation and prompt tokens are context only. Used for the warm start from the synthetic world's
teacher, and by RAG-Gym's SFT on chosen actions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from searchrl.algorithms.base import Algorithm, Requirements
from searchrl.algorithms.loss_terms import nll_loss
from searchrl.core.aggregate import Sum
from searchrl.core.config import AT_LEAST_0, ZERO_TO_ONE, AlgorithmSettings, check_ranges, setting
from searchrl.core.types import RolloutBatch, Segment, Step, Trajectory
from searchrl.rollout.loop import encode

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


@dataclass(frozen=True)
class SFTConfig(AlgorithmSettings):
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = setting(
        "token-mean", "how token losses become the batch's loss"
    )
    loss_on: Literal["actions", "all", "all_but_common_prefix"] = setting(
        "actions",
        "actions: NLL on the agent's tokens only (RAG-Gym SFT, fine-tuning a pretrained model); all: language "
        "modelling on the whole trajectory, documents included, for a model trained from scratch (the local tiny "
        "models), whose documents repeat names and so teach it to copy them; all_but_common_prefix: as all, but "
        "the prompt's start that every record shares (a system prompt with tool schemas) is context, not a target",
    )
    drop_common_prefix: float = setting(
        0.0,
        "the share of records (a fixed draw) trained without the prompt's start that every record shares (a "
        "system prompt with tool schemas): shorter, cheaper rows for a warm start from scratch, the rest keeping "
        "it so that the model reads it as evaluation and RL will give it; 0: every record whole",
        ZERO_TO_ONE,
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
    rec: dict[str, Any],
    tokenizer: Any,
    example: Any = None,
    all_tokens: bool = False,
    context_prefix: int = 0,
    drop_prefix: int = 0,
    prompt_ids: list[int] | None = None,
) -> Trajectory:
    """A text record (prompt, actions, observations) as segments. These are dataset texts, not model
    samples, so tokenizing them here is right; each piece is tokenized on its own, as at rollout time.
    With ``all_tokens`` every piece is a target (segment kind "action"), for language-model training, but for
    the prompt's first ``context_prefix`` tokens, which stay context; the prompt's first ``drop_prefix`` tokens
    are left out. ``prompt_ids``: the prompt already tokenized."""
    context = "action" if all_tokens else "observation"
    prompt = encode(tokenizer, rec["prompt"]) if prompt_ids is None else list(prompt_ids)
    if drop_prefix < len(prompt):  # a prompt that is all shared prefix stays whole: a row starts somewhere
        prompt = prompt[drop_prefix:]
    if not all_tokens:
        segs = [Segment("prompt", prompt)]
    elif 0 < context_prefix < len(prompt):
        segs = [Segment("prompt", prompt[:context_prefix]), Segment("action", prompt[context_prefix:])]
    else:
        segs = [Segment("action", prompt)]
    steps = []
    n = len(prompt)
    for action, obs in zip(rec["actions"], rec["observations"]):
        segs.append(Segment("action", encode(tokenizer, action)))
        n += len(segs[-1].token_ids)
        steps.append(Step(segment=len(segs) - 1, last_token=n - 1, info=None))  # type: ignore[arg-type]
        if obs:
            segs.append(Segment(context, encode(tokenizer, obs)))  # type: ignore[arg-type]
            n += len(segs[-1].token_ids)
    return Trajectory(example=example, segments=segs, steps=steps, finish_reason=rec.get("finish_reason"))


def common_prefix(prompts: Sequence[list[int]]) -> int:
    """How many tokens every prompt starts with (0 for fewer than two distinct prompts)."""
    distinct = {tuple(p) for p in prompts}
    if len(distinct) < 2:
        return 0
    lo, hi = min(distinct), max(distinct)  # what the sorted first and last share, all share
    return next((i for i, (a, b) in enumerate(zip(lo, hi)) if a != b), len(lo))


class SFT(Algorithm):
    Config = SFTConfig

    @classmethod
    def requires(cls, config: SFTConfig, env: EnvConfig) -> Requirements:
        return Requirements(online=False, data="trajectories", old_logprobs=False)

    def __init__(self, config: SFTConfig, ctx: Any) -> None:
        super().__init__(config, ctx)
        if not ctx.records:
            raise ValueError("SFT needs training records (teacher trajectories or a dataset of them)")
        all_tokens = config.loss_on != "actions"
        cut = config.loss_on == "all_but_common_prefix" or config.drop_common_prefix > 0
        # each distinct prompt tokenized once, for the common prefix and the rows
        prompts = (
            {p: encode(ctx.tokenizer, p) for p in dict.fromkeys(r["prompt"] for r in ctx.records)}
            if cut
            else {}
        )
        shared = common_prefix(list(prompts.values()))
        rng = random.Random(0)  # which records lose it: the same in every process and run
        context = shared if config.loss_on == "all_but_common_prefix" else 0
        self.trajs = []
        for r in ctx.records:
            drop = shared if rng.random() < config.drop_common_prefix else 0
            self.trajs.append(
                record_to_trajectory(
                    r,
                    ctx.tokenizer,
                    all_tokens=all_tokens,
                    context_prefix=0 if drop else context,
                    drop_prefix=drop,
                    prompt_ids=prompts.get(r["prompt"]),
                )
            )

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
