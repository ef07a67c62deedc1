"""Step judges for SLATE's dense rewards (§3.3): each part of a step scored in {−1, 0, +1}.

A judge scores a batch of `JudgeItem`s (one candidate action each, with the prefix it continues and,
for searches, what the query retrieved) and returns `JudgeScores`. Judges are registered in `JUDGES`
and chosen by name in the SLATE config; a judge that fails on an item returns 0 for it and sets
``failed`` (SLATE counts failures in its metrics and never crashes on them).

`rule_judge` runs on the CPU from the example's decomposition:

- think: +1 if the reasoning names the entity the next unresolved hop needs (that hop's gold title, or
  the previous hop's answer), 0 if it names only other entities of the question's chain (vague),
  −1 if it names none of them or there is no reasoning;
- query: +1 if it retrieves a gold document not yet seen in the prefix, 0 if only already-seen gold
  documents, −1 if no gold document (or the search was malformed);
- answer: +1 for an exact match, 0 for a partial match (F1 > 0), −1 otherwise.

The LLM judge (reason-then-score prompts, local or OpenAI-compatible backends) is in `rewards.llm_judge`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from searchrl.core.answers import exact_match, f1_score, normalize_answer
from searchrl.core.records import Doc
from searchrl.core.registry import Registry
from searchrl.core.types import EnvState, StepInfo

JUDGES: Registry[Callable[..., Any]] = Registry("judge")
JUDGES.add_lazy("llm", "searchrl.rewards.llm_judge:LLMJudge")
# Annotators rank the candidate actions of one state (RAG-Gym process-data collection): higher is better.
ANNOTATORS: Registry[Callable[..., Any]] = Registry("annotator")


@dataclass(frozen=True)
class JudgeItem:
    prefix: EnvState  # the episode before this step (question, earlier actions and observations)
    action: str  # the candidate action text, as generated
    info: StepInfo  # the environment's parse of it (kind, query, answer, validity)
    retrieved: tuple[Doc, ...] = ()  # what the candidate's query brought back (searches)

    @classmethod
    def of(cls, prefix: Any, candidate: Any) -> JudgeItem:
        """The item for ``candidate`` (a `Trajectory` one step past ``prefix``)."""
        ep = candidate.episode
        return cls(prefix.episode, ep.actions[-1], ep.infos[-1], tuple(ep.retrieved[-1]))


@dataclass(frozen=True)
class JudgeScores:
    think: float
    query: float = 0.0  # search steps
    answer: float = 0.0  # answer steps
    failed: bool = False


_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def think_text(action: str) -> str | None:
    m = _THINK.search(action)
    return m.group(1) if m else None


def _mentions(text: str, name: str | None) -> bool:
    n = normalize_answer(name or "")
    return bool(n) and f" {n} " in f" {normalize_answer(text)} "


def seen_docs(state: EnvState) -> set[str]:
    return {d.id for docs in state.retrieved for d in docs}


def gold_docs(example: Any) -> set[str]:
    return {h.gold_doc_id for h in example.hops if h.gold_doc_id} | set(example.gold_doc_ids)


def next_hop(state: EnvState) -> int:
    """The first hop not resolved in this episode: its gold document retrieved (or, without gold
    documents, its answer read in an observation); ``len(hops)`` when all are."""
    hops, seen = state.example.hops, seen_docs(state)
    context = " ".join(state.observations)
    n = 0
    while n < len(hops) and (
        (hops[n].gold_doc_id in seen) if hops[n].gold_doc_id else _mentions(context, hops[n].answer)
    ):
        n += 1
    return n


class RuleJudge:
    """The CPU judge described in the module docstring (uses ``example.hops``)."""

    def __call__(self, items: Sequence[JudgeItem]) -> list[JudgeScores]:
        return [self.score(it) for it in items]

    def score(self, it: JudgeItem) -> JudgeScores:
        ex = it.prefix.example
        hops = ex.hops
        seen = seen_docs(it.prefix)
        nxt = next_hop(it.prefix)
        if nxt < len(hops):
            needed = [hops[nxt].gold_title or (hops[nxt - 1].answer if nxt > 0 else None)]
        else:  # every hop resolved: the reasoning should name the final answer
            needed = [hops[-1].answer] if hops else list(ex.answers[:1])
        chain = {h.gold_title for h in hops} | {h.answer for h in hops} | set(ex.answers[:1])
        think = think_text(it.action)
        if think is None or not think.strip():
            r_think = -1.0
        elif any(_mentions(think, n) for n in needed):
            r_think = 1.0
        elif any(_mentions(think, n) for n in chain):
            r_think = 0.0
        else:
            r_think = -1.0
        if it.info.kind == "search":
            got = {d.id for d in it.retrieved} & gold_docs(ex)
            r_query = -1.0 if not it.info.valid or not got else (1.0 if got - seen else 0.0)
            return JudgeScores(r_think, query=r_query)
        if it.info.kind == "answer" and it.info.valid and it.info.answer is not None:
            if exact_match(it.info.answer, ex.answers):
                r_answer = 1.0
            else:
                r_answer = 0.0 if f1_score(it.info.answer, ex.answers) > 0 else -1.0
            return JudgeScores(r_think, answer=r_answer)
        return JudgeScores(r_think, answer=-1.0)  # malformed: neither a search nor an answer


JUDGES.add("rule", RuleJudge)


class RuleAnnotator:
    """RAG-Gym's criteria (§2.2.1) from the decomposition, as a rank score per candidate:

    - answer: 2 if exact, 0 if partial (F1 > 0), −2 if wrong;
    - search, sufficiency first: −1 when every hop is already resolved (answering is preferred);
      utility: 1 when it retrieves a gold document not seen before; redundancy: −2 when every document
      it retrieves was seen before; otherwise −1 (nothing useful);
    - a malformed action: −3.
    """

    def __call__(self, items: Sequence[JudgeItem]) -> list[float]:
        return [self.rank(it) for it in items]

    def rank(self, it: JudgeItem) -> float:
        ex, info = it.prefix.example, it.info
        if not info.valid:
            return -3.0
        if info.kind == "answer" and info.answer is not None:
            return (
                2.0
                if exact_match(info.answer, ex.answers)
                else (0.0 if f1_score(info.answer, ex.answers) > 0 else -2.0)
            )
        if info.kind != "search":
            return -3.0
        if ex.hops and next_hop(it.prefix) >= len(ex.hops):
            return -1.0
        seen, got = seen_docs(it.prefix), {d.id for d in it.retrieved}
        if (got & gold_docs(ex)) - seen:
            return 1.0
        return -2.0 if got and got <= seen else -1.0


class JudgeAnnotator:
    """Ranks by a judge's total score (e.g. the LLM judge: reasoning + query or answer)."""

    def __init__(self, judge: str = "llm", **judge_args: Any) -> None:
        self.judge = JUDGES.get(judge)(**judge_args)

    def __call__(self, items: Sequence[JudgeItem]) -> list[float]:
        return [s.think + s.query + s.answer for s in self.judge(items)]


ANNOTATORS.add("rule", RuleAnnotator)
ANNOTATORS.add("judge", JudgeAnnotator)
