"""AutoRefine's reward (Shi et al. 2025, arXiv 2505.11277, §3.2; released code: ``syr-cn/AutoRefine``,
``verl/utils/reward_score/qa_em.py``, ``compute_score_f1``).

The agent writes ``<refine> … </refine>`` after each search's documents, restating what they establish; that
text is part of its action (trained), the documents stay observations (masked). The reward:

    R_ans = F1(final answer, gold)                       (``answer_metric: em``: exact match)
    R_ret = 1 if a normalised gold answer occurs in the normalised refined text (all blocks joined), else 0
    R     = R_ans                                       if R_ans > 0
          = refine_score · R_ret + format_score · valid  otherwise (no final answer: 0)

with refine_score 0.1 (the paper's) and format_score 0 (its released scripts'). ``valid``: every one of
<think>, <search>, <refine> and <answer> is opened at least once and as often as it is closed, in the agent's
text (AutoRefine's ``validate_format``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from searchrl.core.answers import exact_match, f1_score, sub_exact_match
from searchrl.envs.tags import REFINE_CLOSE, REFINE_OPEN
from searchrl.rewards.contract import RewardOutput

_BLOCK = re.compile(re.escape(REFINE_OPEN) + r"(.*?)" + re.escape(REFINE_CLOSE), re.S)


def refined_text(actions: Sequence[str]) -> str | None:
    """The refine blocks of an episode's actions, joined by spaces; None when it wrote none."""
    blocks = [b for a in actions for b in _BLOCK.findall(a)]
    return " ".join(blocks).strip() if blocks else None


def well_formed(actions: Sequence[str]) -> bool:
    """Each of the four tags opened at least once and as often as closed, over the agent's own text."""
    text = "".join(actions)
    for tag in ("think", "search", "refine", "answer"):
        opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
        if opened == 0 or opened != closed:
            return False
    return True


def autorefine_reward(
    traj: Any,
    *,
    answers: Sequence[str],
    answer_metric: Literal["f1", "em"] = "f1",
    refine_score: float = 0.1,
    format_score: float = 0.0,
) -> RewardOutput:
    """AutoRefine's reward (module docstring); metrics ``refine_hit`` (R_ret) and ``refine_blocks``."""
    if answer_metric not in ("f1", "em"):
        raise ValueError(f"autorefine: answer_metric must be 'f1' or 'em', got {answer_metric!r}")
    state = getattr(traj, "state", None)
    actions = list(state.actions) if state is not None else []
    refined = refined_text(actions)
    hit = sub_exact_match(refined, answers) if refined is not None else 0.0
    metrics = {"refine_hit": hit, "refine_blocks": float(sum(len(_BLOCK.findall(a)) for a in actions))}
    pred = getattr(traj, "answer", None)
    if pred is None:
        return RewardOutput(score=0.0, metrics=metrics)
    ans = f1_score(pred, answers) if answer_metric == "f1" else exact_match(pred, answers)
    if ans > 0:
        return RewardOutput(score=ans, metrics=metrics)
    return RewardOutput(score=refine_score * hit + format_score * well_formed(actions), metrics=metrics)
