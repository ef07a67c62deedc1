"""Answer judges: is the agent's final answer correct, as a grader model reads it?

Deep-research benchmarks and the search agents of 2025-26 score answers with an LLM judge where exact match
is too strict (aliases, paraphrases, dates written two ways): ASearcher and EvolveSearch train on a judge's
verdict, s3 rewards *generation accuracy*, cover EM or the judge (docs/rewards.md, "Answer judges").

- `AnswerJudge`: one verdict per (question, gold answers, prediction): True, False, or None when the judge
  failed (timeout, HTTP error, a reply with no verdict). It reuses the judge and summarizer client
  (`searchrl.rollout.chat.chat_client`: a local model or any OpenAI-compatible endpoint); failures are
  counted per service (``service/answer_judge/…``) and above ``max_failure_rate`` the run stops.
- `judge_reward` (``rewards: [{name: judge, args: {...}}]``): 1 if the judge says correct, else 0; a failed
  verdict scores 0 (and is counted).
- `gen_acc_reward` (``gen_acc``): s3's generation accuracy (arXiv 2505.14146, §3.2): 1 when the normalised
  gold answer occurs in the normalised prediction (cover EM), else the judge's verdict. Only the answers that
  cover EM misses are sent to the judge.

Both are batched rewards (classes: built once with their ``args``, called with a step's trajectories).

The prompt is ours, written for this toolkit (`PROMPT`); it follows the pattern the papers above describe:
the question, the gold answers, the prediction, one word back. It asks for a verdict in a tag so that a
reasoning model's thinking is never read as its verdict.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

from searchrl.core.answers import sub_exact_match
from searchrl.rewards.contract import RewardOutput

SYSTEM = "You grade answers to questions. You are strict about facts and lenient about wording."

PROMPT = """Question: {question}
Gold answer(s): {gold}
Predicted answer: {prediction}

Is the predicted answer correct? It is correct when it refers to the same entity, date, number or fact as
one of the gold answers, even if it is worded differently (an alias, an abbreviation, a paraphrase, extra
words that do not change its meaning). It is incorrect when it is wrong, names something else, hedges
between several answers, or is empty. Reply with <verdict>correct</verdict> or <verdict>incorrect</verdict>."""

_VERDICT = re.compile(r"<verdict>\s*(correct|incorrect)\s*</verdict>", re.I)
_BARE = re.compile(r"\b(correct|incorrect)\b", re.I)


def parse_verdict(reply: str | None) -> bool | None:
    """The last ``<verdict>correct|incorrect</verdict>`` of a reply; without one, a reply that is a bare
    ``correct`` / ``incorrect`` (ignoring case and punctuation); None otherwise."""
    if not reply:
        return None
    tagged = _VERDICT.findall(reply)
    if tagged:
        return tagged[-1].lower() == "correct"
    words = _BARE.findall(reply)
    if len(words) == 1 and len(reply.strip(" \n\t.!*\"'`")) == len(words[0]):
        return words[0].lower() == "correct"
    return None


class AnswerJudge:
    """Batched verdicts from a chat model (``backend: openai``: ``url`` up to ``/v1`` and ``model``; ``hf``:
    ``model`` is a local directory). The API key is read from ``api_key_env`` and never logged."""

    def __init__(
        self,
        *,
        backend: str = "openai",
        model: str = "",
        url: str = "http://127.0.0.1:8001/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        max_tokens: int = 64,
        temperature: float = 0.0,
        timeout: float = 60.0,
        retries: int = 2,
        workers: int = 8,
        max_failure_rate: float = 0.05,
        max_answer_chars: int = 500,
        key: str = "judge",
    ) -> None:
        from searchrl.rollout.chat import client_from_args

        self.max_tokens, self.temperature, self.max_answer_chars = max_tokens, temperature, max_answer_chars
        self.client = client_from_args(
            {
                "backend": backend,
                "model": model,
                "url": url,
                "api_key_env": api_key_env,
                "timeout": timeout,
                "retries": retries,
                "workers": workers,
                "max_failure_rate": max_failure_rate,
            },
            key,
            "answer_judge",
        )

    def __call__(self, items: Sequence[tuple[str, Sequence[str], str | None]]) -> list[bool | None]:
        """One verdict per (question, gold answers, prediction). A missing or empty prediction is incorrect
        without asking."""
        asked = [i for i, (_, _, pred) in enumerate(items) if pred and pred.strip()]
        convs = []
        for i in asked:
            question, golds, pred = items[i]
            prompt = PROMPT.format(
                question=question,
                gold=" | ".join(golds) or "(none)",
                prediction=str(pred)[: self.max_answer_chars],
            )
            convs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])
        replies = self.client.complete(convs, self.max_tokens, self.temperature) if convs else []
        out: list[bool | None] = [False] * len(items)
        for i, reply in zip(asked, replies):
            verdict = parse_verdict(reply)
            if verdict is None and reply is not None:  # answered, but no verdict: a failure like any other
                self.client.counter.reject(f"a reply had no <verdict>: {reply[-160:]!r}")
            out[i] = verdict
        return out


def _item(traj: Any) -> tuple[str, Sequence[str], str | None]:
    ex = traj.example
    return ex.question, tuple(ex.answers), getattr(traj, "answer", None)


class JudgeReward:
    """``judge``: 1 when the answer judge says the final answer is correct, else 0 (a failed verdict is 0 and
    is counted: ``reward/judge/failed``). ``args`` are `AnswerJudge`'s."""

    def __init__(self, **judge: Any) -> None:
        self.judge = AnswerJudge(**{"key": "rewards.judge.args", **judge})

    def __call__(self, trajs: Sequence[Any]) -> list[RewardOutput]:
        verdicts = self.judge([_item(t) for t in trajs])
        return [RewardOutput(float(bool(v)), metrics={"failed": float(v is None)}) for v in verdicts]


class GenAccReward:
    """``gen_acc``: s3's generation accuracy, cover EM or else the judge's verdict (arXiv 2505.14146, §3.2).
    ``reward/gen_acc/cover_em`` and ``…/judged`` say which decided."""

    def __init__(self, **judge: Any) -> None:
        self.judge = AnswerJudge(**{"key": "rewards.gen_acc.args", **judge})

    def __call__(self, trajs: Sequence[Any]) -> list[RewardOutput]:
        items = [_item(t) for t in trajs]
        covered = [p is not None and sub_exact_match(p, golds) > 0 for _, golds, p in items]
        rest = [i for i, c in enumerate(covered) if not c]
        verdicts = dict(zip(rest, self.judge([items[i] for i in rest])))
        out = []
        for i, c in enumerate(covered):
            v = True if c else verdicts[i]
            out.append(
                RewardOutput(
                    float(bool(v)),
                    metrics={"cover_em": float(c), "judged": float(not c), "failed": float(v is None)},
                )
            )
        return out


def judge_accuracy(
    judge: AnswerJudge, items: Sequence[tuple[str, Sequence[str], str | None]]
) -> dict[str, float]:
    """Evaluation's judge columns over (question, gold answers, prediction) items: ``judge_acc`` (the judge's
    verdicts), ``gen_acc`` (cover EM or the judge), ``judge_failures`` (verdicts the judge did not give, scored
    incorrect) and ``judge_em_agreement`` (the share of questions where the judge and EM agree)."""
    from searchrl.core.answers import exact_match

    if not items:
        return {}
    verdicts = judge(items)
    n = len(items)
    em = [p is not None and exact_match(p, g) > 0 for _, g, p in items]
    cover = [p is not None and sub_exact_match(p, g) > 0 for _, g, p in items]
    return {
        "judge_acc": sum(bool(v) for v in verdicts) / n,
        "gen_acc": sum(c or bool(v) for c, v in zip(cover, verdicts)) / n,
        "judge_failures": sum(v is None for v in verdicts) / n,
        "judge_em_agreement": sum(bool(v) == e for v, e in zip(verdicts, em)) / n,
    }


def _judge_arguments() -> inspect.Signature:
    """`AnswerJudge`'s arguments (less ``key``): what ``validate`` checks a judge reward's ``args`` against."""
    sig = inspect.signature(AnswerJudge)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "key"])


JudgeReward.__signature__ = _judge_arguments()  # type: ignore[attr-defined]
GenAccReward.__signature__ = _judge_arguments()  # type: ignore[attr-defined]
