"""Outcome rewards on the final answer of the plain <answer> style."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from searchrl.answers import exact_match, f1_score
from searchrl.rewards.registry import RewardOutput


def _final_answer(traj: Any) -> str | None:
    """The episode's extracted final answer (`SearchEnv` parses it; None when there is none)."""
    return getattr(traj, "answer", None)


def em_reward(traj: Any, *, answers: Sequence[str], **_: Any) -> RewardOutput:
    """1 if the last <answer> matches a gold answer after normalisation, else 0 (Search-R1)."""
    pred = _final_answer(traj)
    return RewardOutput(score=exact_match(pred, answers) if pred is not None else 0.0)


def f1_reward(traj: Any, *, answers: Sequence[str], **_: Any) -> RewardOutput:
    """Token F1 of the last <answer> against the best gold answer."""
    pred = _final_answer(traj)
    return RewardOutput(score=f1_score(pred, answers) if pred is not None else 0.0)
