"""A user's own reward recipes, kept in their own module and named in the experiment file by dotted path.

Nothing here is part of searchrl: it only imports the public API. Run it with

    PYTHONPATH=examples/custom_reward searchrl train examples/custom_reward/experiment.yaml

A reward receives the finished trajectory (``traj.state`` holds every action, observation, parsed step
and retrieved document) plus whichever example fields it names as keyword-only parameters (``answers``,
``hops``, ``metadata``, ``example``, or the corpus as ``docs``); its other keyword-only parameters are the
``args`` of the experiment file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from searchrl import Hop, RewardOutput, f1_score, register_reward


@register_reward("gold_hits", kind="process")
def gold_hits(
    traj: Any, *, hops: Sequence[Hop], hit: float = 1.0, repeat_penalty: float = 0.5
) -> RewardOutput:
    """Process reward: ``hit`` for each search that brings back a gold document of the decomposition for
    the first time, ``-repeat_penalty`` for a search whose documents were all seen before; the outcome
    score is the share of gold documents found."""
    gold = {h.gold_doc_id for h in hops if h.gold_doc_id}
    seen: set[str] = set()
    found: set[str] = set()
    scores = []
    for step in traj.steps:
        i = next(k for k, info in enumerate(traj.state.infos) if info is step.info)
        ids = {d.id for d in traj.state.retrieved[i]}
        if step.info.kind != "search" or not ids:
            scores.append(0.0)
            continue
        new_gold = (ids & gold) - found
        scores.append(hit if new_gold else (-repeat_penalty if ids <= seen else 0.0))
        found |= ids & gold
        seen |= ids
    return RewardOutput(
        score=len(found) / max(len(gold), 1),
        step_scores=tuple(scores),
        metrics={"gold_found": float(len(found))},
    )


def answer_f1_or_floor(traj: Any, *, answers: Sequence[str], floor: float = 0.0) -> float:
    """Outcome reward without registration (dotted path only): answer F1, at least ``floor`` if answered."""
    if traj.answer is None:
        return 0.0
    return max(f1_score(traj.answer, answers), floor)
