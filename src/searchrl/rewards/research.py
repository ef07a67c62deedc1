"""ReSearch's reward (§2.3, eq. 2) and its format check."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from searchrl.core.answers import f1_score
from searchrl.rewards.contract import RewardOutput

_TAG = re.compile(r"</?(think|search|result|information|answer)>")


STOPS = ("</search>", "</answer>")


def cut_at_stop(action: str) -> str:
    """An action up to the end of its first closing tag: what a generator that stops at the tag returns,
    without the characters its last token may carry after it (`SearchEnv.parse` reads it the same way).
    The public codes truncate there too (Search-R1 cuts the text after ``</answer>`` and re-tokenizes)."""
    ends = [i + len(t) for t in STOPS if (i := action.find(t)) >= 0]
    return action[: min(ends)] if ends else action


def response_text(traj: Any, cut: bool = False) -> str:
    """Everything after the prompt: actions and observations in order (``cut``: actions cut at their first
    closing tag, as the public codes see them)."""
    st = traj.state
    return "".join((cut_at_stop(a) if cut else a) + o for a, o in zip(st.actions, st.observations))


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
    traj: Any,
    *,
    answers: Sequence[str],
    format_score: float = 0.1,
    info_tag: str = "result",
    public_code_compat: bool = False,
) -> RewardOutput:
    """ReSearch eq. (2): F1 of the \\boxed{} answer if it is above 0; ``format_score`` (0.1) if F1 is 0 but
    the format is valid; 0 otherwise. F1 with HotpotQA's yes/no rule, as ReSearch's code computes it (the
    paper does not say). ``public_code_compat``: `research_public`, the public code's computation."""
    if public_code_compat:
        return research_public(traj, answers=answers, format_score=format_score)
    pred = traj.answer  # SearchEnv extracts the \boxed{} content under the research tag set
    f1 = f1_score(pred, answers) if pred else 0.0
    fmt = research_format_ok(response_text(traj), info_tag)
    score = f1 if f1 > 0 else (format_score if fmt else 0.0)
    return RewardOutput(score=score, metrics={"f1": f1, "format_ok": float(fmt)})


def research_public_format_ok(response: str) -> bool:
    """ReSearch's public format check: as many ``<think>`` as ``</think>`` and at least one; exactly one
    ``<answer>`` and one ``</answer>``; every ``<search>`` followed by ``</search>``, ``<result>``,
    ``</result>`` in that order; ``\\boxed{`` and ``}`` between ``<answer>`` and ``</answer>``. Text after
    the answer is not checked."""
    n_think = response.count("<think>")
    if n_think != response.count("</think>") or n_think == 0:
        return False
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return False
    pos = 0
    while (s := response.find("<search>", pos)) >= 0:
        r = response.find("<result>", s)
        s_end, r_end = response.find("</search>", s), response.find("</result>", r)
        if -1 in (r, s_end, r_end) or not s < s_end < r < r_end:
            return False
        pos = r_end
    a, a_end = response.find("<answer>"), response.find("</answer>")
    inside = response[a:a_end]
    return a <= a_end and "\\boxed{" in inside and "}" in inside


def _public_boxed(answer_part: str) -> str | None:
    """The public code's answer: the last ``\\boxed `` (space) expression up to ``$``, else the last
    ``\\boxed{…}`` (or ``\\fbox{…}``) with braces matched; None where its code would raise."""
    if "\\boxed " in answer_part:
        return answer_part.split("\\boxed ")[-1].split("$")[0]
    start = answer_part.rfind("\\boxed")
    if start < 0:
        start = answer_part.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(answer_part)):
        depth += {"{": 1, "}": -1}.get(answer_part[i], 0)
        if answer_part[i] == "}" and depth == 0:
            boxed = answer_part[start : i + 1]
            return boxed[len("\\boxed{") : -1] if boxed.startswith("\\boxed{") else None
    return None


def research_public(traj: Any, *, answers: Sequence[str], format_score: float = 0.1) -> RewardOutput:
    """ReSearch's reward as its public code computes it (Agent-RL/ReSearch,
    ``src/verl/utils/reward_score/re_search.py``, the last version before the ReCall rename), on the decoded
    response (actions cut at their first closing tag, observations). Differences from eq. (2):

    - the format gates everything: a bad format scores 0 even when the answer's F1 is above 0;
    - the format (`research_public_format_ok`) needs at least one ``<think>`` pair, and accepts text after
      ``</answer>``;
    - a response that did not end with the end-of-sequence token ("over length") scores 0: here an episode
      that ended without an answer or EOS (length, turn budget);
    - the answer is the first answer block's last boxed expression; no boxed expression scores 0.
    """
    st = traj.state
    # the public code splits prompt + response at the chat template's marker (else "Assistant:") and scores
    # what follows the first one, up to a second one: `(prompt + response).split(marker)[1]`. Under a chat
    # template the first marker ends the prompt; under the base template a response that writes the marker
    # is scored from after it. No marker at all: the public code fails on the index, scored 0 here.
    chat = "<|im_start|>assistant\n"
    text = (st.prompt if st is not None else "") + response_text(traj, cut=True)
    parts = text.split(chat if chat in text else "Assistant:")
    response = parts[1] if len(parts) > 1 else ""
    metrics = {"f1": 0.0, "format_ok": 0.0}
    if not research_public_format_ok(response):
        return RewardOutput(0.0, metrics=metrics)
    metrics["format_ok"] = 1.0
    if traj.finish_reason not in ("answer", "eos") or st is None:
        return RewardOutput(0.0, metrics=metrics)
    found = re.search(r"<answer>(.*?)</answer>", response.strip(), re.S)
    boxed = _public_boxed(found.group(1)) if found else None
    if boxed is None:
        return RewardOutput(0.0, metrics=metrics)
    f1 = f1_score(boxed, answers)
    metrics["f1"] = f1
    return RewardOutput(f1 if f1 > 0 else format_score, metrics=metrics)
