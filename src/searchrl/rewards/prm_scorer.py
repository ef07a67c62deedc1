"""A trained process reward model (`algorithms.prm`) as a scorer: for PRM-guided best-of-N inference
(RAG-Gym Appendix D, Algorithm 1) and as a process reward for the online algorithms (``name: prm``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from searchrl.rewards.contract import RewardOutput


class PRMScorer:
    """r(s, a) for token-id states and actions, batched; loads ``<dir>`` (LM or adapter + scoring head)."""

    def __init__(self, path: str | Path, batch_size: int = 32) -> None:
        from safetensors.torch import load_file

        from searchrl.models.load import load_model_and_tokenizer
        from searchrl.models.policy import VALUE_HEAD_FILE, PolicyWithValue

        head = Path(path) / VALUE_HEAD_FILE
        if not head.exists():
            raise FileNotFoundError(
                f"{path} holds no {VALUE_HEAD_FILE}: not a PRM trained by `algorithm: prm`"
            )
        lm, self.tokenizer = load_model_and_tokenizer(path, whole=True)
        self.model = PolicyWithValue(lm)
        self.model.value_head.load_state_dict(load_file(str(head)))
        self.model.eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, states: list[list[int]], actions: list[list[int]]) -> list[float]:
        from searchrl.models.policy import forward

        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        out: list[float] = []
        for i in range(0, len(states), self.batch_size):
            rows = [
                s + a + [eos]
                for s, a in zip(states[i : i + self.batch_size], actions[i : i + self.batch_size])
            ]
            T = max(len(r) for r in rows)
            ids = torch.full((len(rows), T), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, r in enumerate(rows):
                ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
            _, values = forward(self.model, ids, mask, values=True)
            assert values is not None
            # the value at the appended token is the head on the action's last token
            out += [float(values[b, len(r) - 1]) for b, r in enumerate(rows)]
        return out


@lru_cache(maxsize=2)
def _scorer(path: str) -> PRMScorer:
    return PRMScorer(path)


def prm_reward(traj: Any, *, model: str, scale: float = 1.0) -> RewardOutput:
    """Process reward: ``scale`` · r(s_t, a_t) at each step; the outcome score is their mean."""
    scorer = _scorer(str(model))
    states = [traj.state_ids(i) for i in range(len(traj.steps))]
    actions = [traj.action_ids(i) for i in range(len(traj.steps))]
    scores = [scale * s for s in scorer.score(states, actions)] if states else []
    return RewardOutput(score=sum(scores) / max(len(scores), 1), step_scores=tuple(scores))
