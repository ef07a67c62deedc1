"""SLATE's LLM-as-judge (§3.3, Appendix A.10): reason-then-score prompts for the reasoning, the query and
the answer of a step, each scored in {−1, 0, +1}.

The prompt text is ours, following the paper's description: the judge sees the question and the trajectory
so far, weighs the criteria the paper lists (thinking: relevance, clarity, specificity, progress,
faithfulness; query: relevance, specificity, searchability, alignment, novelty, with the documents the
query retrieved; answer: same information as the gold answer), writes its reasoning first and ends with
``<score>…</score>``. Requests are batched (local model) or sent concurrently (endpoint).

Backends:

- ``backend: hf`` — a local Hugging Face model (``model``: its directory);
- ``backend: openai`` — any OpenAI-compatible chat endpoint (``url`` up to ``/v1``, ``model``; the API key
  is read from the environment variable named by ``api_key_env`` and never logged). A local model can
  be served that way with ``searchrl serve-model``.

A request that times out, fails, or returns no parsable score scores 0 and is counted as a failure, both in
``slate/judge_failures`` and per service (``service/judge/failures``, the console summary): above
``max_failure_rate`` (default 5%) of the requests the run stops with an error naming the endpoint and the
HTTP status or the unparsable reply, never the key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from searchrl.core.types import EnvState
from searchrl.rewards.judges import JudgeItem, JudgeScores, think_text
from searchrl.rollout.chat import client_from_args

SYSTEM = (
    "You are a strict grader of a search agent that answers questions by reasoning and calling a search "
    "engine. Think through the criteria first, then give one score: 1 (good), 0 (partly good or vague) or "
    "-1 (bad). End with the score alone inside <score></score>, e.g. <score>1</score>."
)

THINK = """Question: {question}

Trajectory so far:
{context}

The agent's next reasoning step:
{thinking}

Grade the reasoning on relevance to the question, clarity, specificity (does it name the information it
still needs?), progress over the trajectory so far, and faithfulness to what was retrieved.
1: clear, relevant, names a specific information need. 0: somewhat relevant but vague.
-1: irrelevant, misleading or counterproductive. Explain briefly, then give <score></score>."""

QUERY = """Question: {question}

Trajectory so far:
{context}

The agent's reasoning: {thinking}
The agent's search query: {query}
What the query retrieved:
{documents}

Grade the query on relevance, specificity, searchability (clear keywords), alignment with the reasoning,
and novelty with respect to earlier searches, in the light of what it retrieved.
1: specific, well-formed, finds what is needed. 0: some specificity but generic. -1: irrelevant or poorly
formed. Explain briefly, then give <score></score>."""

ANSWER = """Question: {question}
Gold answer: {gold}
The agent's answer: {answer}

Does the agent's answer convey the same information as the gold answer (paraphrases and aliases count)?
1: correct. 0: partially correct or ambiguous. -1: incorrect. Explain briefly, then give <score></score>."""

_SCORE = re.compile(r"<score>\s*([+-]?\s*[01])(?:\.0*)?\s*</score>", re.I)
_FALLBACK = re.compile(r"score\W{0,4}?[:=]?\s*\**\s*([+-]?\s*[01])\b", re.I)


def parse_score(text: str | None) -> float | None:
    """The last ``<score>x</score>`` with x in {-1, 0, 1} (also ``+1``, ``1.0``), else the last
    ``Score: x``; None when there is neither."""
    if not text:
        return None
    for pattern in (_SCORE, _FALLBACK):
        found = pattern.findall(text)
        if found:
            return float(found[-1].replace(" ", ""))
    return None


def render_context(state: EnvState, max_chars: int) -> str:
    parts = [
        f"Step {i + 1}: {a.strip()}\n{o.strip()}"
        for i, (a, o) in enumerate(zip(state.actions, state.observations))
    ]
    text = "\n".join(parts) or "(nothing yet)"
    return text if len(text) <= max_chars else "…" + text[-max_chars:]


class LLMJudge:
    def __init__(
        self,
        backend: str = "openai",
        model: str = "",
        url: str = "http://127.0.0.1:8001/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        max_tokens: int = 256,
        temperature: float = 0.0,
        timeout: float = 60.0,
        retries: int = 2,
        workers: int = 8,
        max_context_chars: int = 6000,
        max_failure_rate: float = 0.05,
    ) -> None:
        self.max_tokens, self.temperature, self.max_context = max_tokens, temperature, max_context_chars
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
            "judge_args",
            "judge",
        )

    def __call__(self, items: Sequence[JudgeItem]) -> list[JudgeScores]:
        requests: list[tuple[int, str, str]] = []  # (item, part, prompt)
        for i, it in enumerate(items):
            st = it.prefix
            ctx = render_context(st, self.max_context)
            thinking = (think_text(it.action) or "").strip() or "(no reasoning)"
            requests.append(
                (i, "think", THINK.format(question=st.example.question, context=ctx, thinking=thinking))
            )
            if it.info.kind == "search" and it.info.valid:
                docs = "\n".join(f"- {d.title}: {d.text[:500]}" for d in it.retrieved) or "(nothing)"
                requests.append(
                    (
                        i,
                        "query",
                        QUERY.format(
                            question=st.example.question,
                            context=ctx,
                            thinking=thinking,
                            query=it.info.query,
                            documents=docs,
                        ),
                    )
                )
            elif it.info.kind == "answer" and it.info.valid:
                requests.append(
                    (
                        i,
                        "answer",
                        ANSWER.format(
                            question=st.example.question,
                            gold=" / ".join(st.example.answers),
                            answer=it.info.answer,
                        ),
                    )
                )
        replies = self.client.complete(
            [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for _, _, p in requests],
            self.max_tokens,
            self.temperature,
        )
        parts: list[dict[str, float]] = [{} for _ in items]
        failed = [False] * len(items)
        for (i, part, _), reply in zip(requests, replies):
            score = parse_score(reply)
            failed[i] |= score is None
            parts[i][part] = score if score is not None else 0.0
            if score is None and reply is not None:  # answered, but unusable: a failure like any other
                self.client.counter.reject(f"a {part} reply had no <score>: {reply[-160:]!r}")
        out = []
        for i, it in enumerate(
            items
        ):  # a malformed search / answer scores -1 on that part, as the rule judge
            search = it.info.kind == "search"
            out.append(
                JudgeScores(
                    think=parts[i].get("think", 0.0),
                    query=parts[i].get("query", -1.0 if search else 0.0),
                    answer=parts[i].get("answer", 0.0 if search else -1.0),
                    failed=failed[i],
                )
            )
        return out
