"""ReSearch's reward (§2.3, eq. 2) and its format check."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from searchrl.answers import f1_score
from searchrl.rewards.registry import RewardOutput

_TAG = re.compile(r"</?(think|search|result|information|answer)>")


def response_text(traj: Any) -> str:
    """Everything after the prompt: actions and observations in order."""
    st = traj.state
    return "".join(a + o for a, o in zip(st.actions, st.observations))


def research_format_ok(text: str, info_tag: str = "result", boxed: bool = True) -> bool:
    """ReSearch's format: balanced <think>; every <search> closed and followed, in order, by its
    <result> block; exactly one <answer> block, at the end, containing \\boxed{} (``boxed=False``: the
    same structure without \\boxed{}, as Search-R1 and StepSearch check it)."""
    stack: list[str] = []
    awaiting_result = False
    answers = 0
    for m in _TAG.finditer(text):
        tag, closing = m.group(1), m.group(0).startswith("</")
        if tag in ("result", "information") and tag != info_tag:
            return False
        if not closing:
            if stack:  # tags never nest
                return False
            if awaiting_result and tag != info_tag:
                return False
            if tag == info_tag and not awaiting_result:
                return False
            stack.append(tag)
        else:
            if not stack or stack[-1] != tag:
                return False
            stack.pop()
            if tag == "search":
                awaiting_result = True
            elif tag == info_tag:
                awaiting_result = False
            elif tag == "answer":
                answers += 1
    if stack or awaiting_result or answers != 1:
        return False
    tail = text[text.rfind("<answer>") :]
    return (not boxed or bool(re.search(r"\\boxed\{.+?\}", tail))) and tail.rstrip().endswith("</answer>")


def research_reward(
    traj: Any, *, answers: Sequence[str], format_score: float = 0.1, info_tag: str = "result"
) -> RewardOutput:
    """ReSearch eq. (2): F1 of the \\boxed{} answer if it is above 0; ``format_score`` (0.1) if F1 is 0 but
    the format is valid; 0 otherwise."""
    pred = traj.answer  # SearchEnv extracts the \boxed{} content under the research tag set
    f1 = f1_score(pred, answers) if pred else 0.0
    fmt = research_format_ok(response_text(traj), info_tag)
    score = f1 if f1 > 0 else (format_score if fmt else 0.0)
    return RewardOutput(score=score, metrics={"f1": f1, "format_ok": float(fmt)})
