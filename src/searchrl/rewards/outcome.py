"""Outcome rewards on the final answer of the plain <answer> style."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from searchrl.core.answers import exact_match, f1_score
from searchrl.rewards.contract import RewardOutput


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


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by ``penalty``:
    0 for |y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|) / L_cache inside the buffer, −1 beyond L_max."""
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong reward: buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return penalty * (start - length) / buffer
    return -penalty


def overlong_reward(traj: Any, *, max_tokens: int, buffer: int, penalty: float = 1.0) -> RewardOutput:
    """DAPO's overlong reward shaping on the tokens the agent generated in the episode (its action tokens;
    retrieved documents do not count): add it to the outcome reward, e.g.
    ``rewards: [{name: em}, {name: overlong, args: {max_tokens: 200, buffer: 50}}]``."""
    n = int(traj.n_action_tokens)
    value = overlong_penalty(n, max_tokens, buffer, penalty)
    return RewardOutput(score=value, metrics={"overlong/penalised": float(value < 0)})


def search_r1_format_reward(
    traj: Any,
    *,
    answers: Sequence[str],
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.0,
    score: float = 1.0,
    info_tag: str = "information",
    public_code_compat: bool = False,
) -> RewardOutput:
    """Search-R1's format-aware EM reward (its ``qa_em_format`` scorer), case by case:

    | answer EM | structure valid | gold answer in a retrieved block | reward |
    |---|---|---|---|
    | 1 | yes | – | ``score`` |
    | 1 | no | – | ``score − structure_format_score`` |
    | 0 or none | yes | yes | ``structure_format_score + retrieval_score`` |
    | 0 or none | yes | no | ``structure_format_score`` |
    | 0 | no | – | ``final_format_score`` (an answer was given) |
    | none | no | – | 0 |

    "Structure valid" is Search-R1's sequence check (`search_r1_structure_ok`): <think> … </think> before
    every <search> and every <answer>, each search followed by its information block, one answer, at the end,
    nothing but white space between tags. The Search-R1 paper (not in ../shared/papers) describes the format
    reward only in words; this check is its public code's definition. ``retrieval_score`` defaults to 0, as in
    Search-R1's v0.3 training scripts (the scorer's own default too); 0.1 gives the variant of its v0.2.

    ``public_code_compat``: exactly as the public scorer computes it on the decoded sequence: the structure is
    checked after the first ``<|im_start|>assistant`` (a prompt without Qwen's chat template never passes);
    the answer is the last of at least two answer blocks of prompt + response (Search-R1's prompt holds an
    example ``<answer> Beijing </answer>``, so a prompt without one needs two answers in the response).
    """
    from searchrl.core.answers import normalize_answer
    from searchrl.rewards.research import response_text

    golds = [normalize_answer(a) for a in answers]
    if public_code_compat:
        st = traj.state
        text = (st.prompt if st is not None else "") + response_text(traj, cut=True)
        marker = re.search(r"<\|im_start\|>assistant\s*", text)
        valid = marker is not None and search_r1_structure_ok(text[marker.end() :], info_tag)
        blocks = re.findall(r"<answer>(.*?)</answer>", text, re.S)
        pred = blocks[-1].strip() if len(blocks) >= 2 else None
        infos = [
            normalize_answer(b.strip()) for b in re.findall(rf"<{info_tag}>(.*?)</{info_tag}>", text, re.S)
        ]
        retrieved = valid and any(g in b for g in golds for b in infos)  # an empty gold is in every block
    else:
        pred = _final_answer(traj)
        valid = search_r1_structure_ok(response_text(traj, cut=True), info_tag)
        seen = [normalize_answer(o) for o in traj.state.observations] if traj.state is not None else []
        retrieved = any(g in o for g in golds if g for o in seen)
    correct = pred is not None and exact_match(pred, answers) > 0
    if correct:
        out = score if valid else score - structure_format_score
    elif valid:
        out = structure_format_score + (retrieval_score if retrieved else 0.0)
    else:
        out = final_format_score if pred is not None else 0.0
    return RewardOutput(
        out, metrics={"em": float(correct), "format_ok": float(valid), "retrieval_hit": float(retrieved)}
    )


_SR1_TAGS = re.compile(r"(</?(?:think|search|information|answer)>)")


def search_r1_structure_ok(response: str, info_tag: str = "information") -> bool:
    """Search-R1's sequence check on a response: balanced tags, then think → (search → information → think)*
    → answer, nothing but white space outside tags, and nothing after the answer."""
    tags = ("think", "search", info_tag, "answer")
    if any(response.count(f"<{t}>") != response.count(f"</{t}>") for t in tags):
        return False
    moves = {
        ("start", "<think>"): "in_think",
        ("information", "<think>"): "in_think",
        ("in_think", "</think>"): "after_think",
        ("after_think", "<search>"): "in_search",
        ("in_search", "</search>"): "after_search",
        ("after_search", f"<{info_tag}>"): "in_information",
        ("in_information", f"</{info_tag}>"): "information",
        ("after_think", "<answer>"): "in_answer",
        ("in_answer", "</answer>"): "end",
    }
    pattern = (
        _SR1_TAGS if info_tag == "information" else re.compile(rf"(</?(?:think|search|{info_tag}|answer)>)")
    )
    state = "start"
    for part in pattern.split(response):
        if not part.strip():
            continue
        if pattern.fullmatch(part):
            state = moves.get((state, part), "invalid")
            if state == "invalid":
                return False
        elif not state.startswith("in_"):  # text is only allowed inside tags
            return False
    return state == "end"


def tool_env_reward(traj: Any) -> RewardOutput:
    """The reward the episode's stateful tools own: the sum of their ``reward(answer)`` (or TRL's
    ``get_reward()``), read for every episode when it ended, whether or not it called a tool
    (`searchrl.envs.python_tools`; 0 if none has one)."""
    state = getattr(traj, "state", None)
    value = getattr(state, "tool_reward", None)
    return RewardOutput(score=float(value) if value is not None else 0.0)


def cover_em_reward(traj: Any, *, answers: Sequence[str]) -> RewardOutput:
    """Cover EM (R1-Searcher; FlashRAG's 'acc'): 1 if a normalised gold answer occurs inside the normalised
    final answer, else 0. Evaluation reports it as ``sub_em``."""
    from searchrl.core.answers import sub_exact_match

    pred = _final_answer(traj)
    return RewardOutput(score=sub_exact_match(pred, answers) if pred is not None else 0.0)


def action_penalty_reward(
    traj: Any,
    *,
    no_answer: float = 0.2,
    invalid: float = 0.1,
    per_search: float = 0.0,
    max_invalid: int | None = None,
) -> RewardOutput:
    """Action-level penalties (Search-R1++, arXiv 2602.19526, §4.2): added to an answer reward (F1) so that
    not answering stops paying. Its finding: an F1 reward alone collapses into answer avoidance, since a
    wrong answer and no answer both score 0; with penalties on the actions F1 ends above EM.

    score = −(``no_answer`` if the episode gave no valid final answer) − ``invalid`` × (invalid actions, at
    most ``max_invalid``) − ``per_search`` × (searches).

    The paper's exact penalty values are not in the sources at hand (its abstract and summaries state the
    design, not the constants): these defaults are ours, each term a switch (set it to 0). Use as
    ``rewards: [{name: f1}, {name: action_penalty}]``."""
    state = traj.state
    infos = list(state.infos) if state is not None else []
    answered = any(i.kind == "answer" and i.valid for i in infos)
    n_invalid = sum(not i.valid for i in infos)
    if max_invalid is not None:
        n_invalid = min(n_invalid, max_invalid)
    n_search = sum(i.kind == "search" and i.valid for i in infos)
    score = -(0.0 if answered else no_answer) - invalid * n_invalid - per_search * n_search
    return RewardOutput(
        score,
        metrics={"no_answer": float(not answered), "invalid": float(n_invalid), "searches": float(n_search)},
    )


def parallelizable(metadata: Any) -> bool | None:
    """Whether a question's sub-questions are independent: ``metadata["parallelizable"]`` when the data says,
    else HotpotQA's and 2Wiki's ``type: comparison`` (True) or another type (False); None when unknown."""
    meta = metadata or {}
    if "parallelizable" in meta:
        return bool(meta["parallelizable"])
    kind = meta.get("type")
    if isinstance(kind, str) and kind:
        return kind == "comparison"
    return None


def parallel_search_reward(
    traj: Any,
    *,
    answers: Sequence[str],
    metadata: Any = None,
    decomposition: float = 0.2,
    search_count: float = 0.2,
    only_if_correct: bool = True,
    penalise_needless: bool = True,
) -> RewardOutput:
    """ParallelSearch (arXiv 2508.09303): the answer's EM plus a decomposition term and a search-count term.

    score = EM + ``decomposition`` · r_d + ``search_count`` · r_s, where

    - r_d = 1 if the question is parallelizable (`parallelizable`) and the agent put several queries in one
      search, −1 (``penalise_needless``) if it did that on a question that is not, else 0;
    - r_s = 1 − rounds / queries: the share of search rounds saved by running queries together (0 when every
      query had its own round or there was none);
    - with ``only_if_correct`` both terms count only when the answer is exact (accuracy first).

    The paper states the three goals (correctness, decomposition quality, parallel execution benefit) and
    combines them; its exact constants and gating are not in the sources at hand, so the weights, the sign
    of needless decomposition and the gating are assumptions, each a switch (set a weight to 0)."""
    pred = _final_answer(traj)
    correct = pred is not None and exact_match(pred, answers) > 0
    state = traj.state
    searches = [i for i in (state.infos if state is not None else []) if i.kind == "search" and i.valid]
    rounds = len(searches)
    queries = sum(len(i.subqueries) for i in searches)
    used_parallel = any(len(i.queries) > 1 for i in searches)
    can = parallelizable(metadata)
    r_d = 0.0
    if used_parallel and can:
        r_d = 1.0
    elif used_parallel and can is False and penalise_needless:
        r_d = -1.0
    r_s = 1.0 - rounds / queries if queries else 0.0
    gate = 1.0 if (correct or not only_if_correct) else 0.0
    score = float(correct) + gate * (decomposition * r_d + search_count * r_s)
    return RewardOutput(
        score,
        metrics={
            "em": float(correct),
            "decomposition": r_d,
            "rounds_saved": r_s,
            "parallel": float(used_parallel),
            "queries_per_search": queries / rounds if rounds else 0.0,
        },
    )
