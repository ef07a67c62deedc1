"""Outcome rewards on the final answer of the plain <answer> style."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from searchrl.answers import exact_match, f1_score
from searchrl.rewards.registry import RewardOutput


def _final_answer(traj: Any) -> str | None:
    """The episode's extracted final answer (`SearchEnv` parses it; None when there is none)."""
    return getattr(traj, "answer", None)


def em_reward(traj: Any, *, answers: Sequence[str]) -> RewardOutput:
    """1 if the last <answer> matches a gold answer after normalisation, else 0 (Search-R1)."""
    pred = _final_answer(traj)
    return RewardOutput(score=exact_match(pred, answers) if pred is not None else 0.0)


def f1_reward(traj: Any, *, answers: Sequence[str]) -> RewardOutput:
    """Token F1 of the last <answer> against the best gold answer."""
    pred = _final_answer(traj)
    return RewardOutput(score=f1_score(pred, answers) if pred is not None else 0.0)


def search_r1_format_reward(
    traj: Any,
    *,
    answers: Sequence[str],
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.1,
    score: float = 1.0,
    info_tag: str = "information",
) -> RewardOutput:
    """Search-R1's format-aware EM reward (its `qa_em_format` scorer), case by case:

    | answer EM | structure valid | gold answer in a retrieved block | reward |
    |---|---|---|---|
    | 1 | yes | – | ``score`` |
    | 1 | no | – | ``score − structure_format_score`` |
    | 0 or none | yes | yes | ``structure_format_score + retrieval_score`` |
    | 0 or none | yes | no | ``structure_format_score`` |
    | 0 | no | – | ``final_format_score`` (an answer was given) |
    | none | no | – | 0 |

    "Structure valid": every tag closed, each <search> followed by its <information> block, exactly one
    <answer>, at the end (`research.research_format_ok` without \\boxed{}).
    """
    from searchrl.answers import normalize_answer
    from searchrl.rewards.research import research_format_ok, response_text

    pred = _final_answer(traj)
    valid = research_format_ok(response_text(traj), info_tag, boxed=False)
    correct = pred is not None and exact_match(pred, answers) > 0
    golds = [normalize_answer(a) for a in answers if normalize_answer(a)]
    seen = [normalize_answer(o) for o in traj.state.observations] if traj.state is not None else []
    retrieved = any(g in o for g in golds for o in seen)
    if correct:
        out = score if valid else score - structure_format_score
    elif valid:
        out = structure_format_score + (retrieval_score if retrieved else 0.0)
    else:
        out = final_format_score if pred is not None else 0.0
    return RewardOutput(
        out, metrics={"em": float(correct), "format_ok": float(valid), "retrieval_hit": float(retrieved)}
    )
