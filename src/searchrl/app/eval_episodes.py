"""Evaluation: answer metrics and search behaviour over finished episodes, written as JSON and markdown."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from searchrl.core.answers import answer_scores
from searchrl.core.config import RolloutConfig
from searchrl.core.errors import DataError
from searchrl.core.types import EnvState


def redundant_searches(state: EnvState) -> int:
    """Searches whose documents had all been retrieved earlier in the episode."""
    seen: set[str] = set()
    count = 0
    for _, ids in state.searches():
        if ids and set(ids) <= seen:
            count += 1
        seen.update(ids)
    return count


def gold_recall(state: EnvState) -> float | None:
    """Share of the example's gold documents retrieved at some step (None when the data names none)."""
    gold = set(state.example.gold_doc_ids)
    if not gold:
        return None
    got = {d for _, ids in state.searches() for d in ids}
    return len(gold & got) / len(gold)


def gold_recall_by_step(states: Sequence[EnvState]) -> dict[int, float]:
    """Mean share of gold documents retrieved by the end of each search step (1, 2, …), over the questions
    whose data names gold documents; an episode that stopped searching keeps its last value."""
    rows = []
    for st in states:
        gold = set(st.example.gold_doc_ids)
        if not gold:
            continue
        got: set[str] = set()
        curve = []
        for _, ids in st.searches():
            got.update(ids)
            curve.append(len(gold & got) / len(gold))
        rows.append(curve)
    steps = max((len(r) for r in rows), default=0)
    return {
        t + 1: sum((r[t] if t < len(r) else (r[-1] if r else 0.0)) for r in rows) / len(rows)
        for t in range(steps)
    }


def _hops_last(item: tuple[int, Any]) -> tuple[bool, int]:
    return item[0] == 0, item[0]  # known hop counts in order, then the unknown ones


def episode_metrics(states: Sequence[EnvState]) -> dict[str, Any]:
    """Mean EM / F1 / sub-EM, searches, generated tokens and invalid actions per question, finish reasons,
    EM by hop count ("unknown" for questions without a decomposition), gold-document recall (overall and by
    search step)."""
    n = len(states)
    if n == 0:
        return {"n": 0}
    totals: dict[str, float] = defaultdict(float)
    by_hops: dict[int, list[float]] = defaultdict(list)
    reasons: Counter[str] = Counter()
    recalls = []
    actions = invalid = searches = redundant = 0
    for s in states:
        scores = answer_scores(s.answer, s.example.answers)
        for k, v in scores.items():
            totals[k] += v
        by_hops[s.example.n_hops].append(scores["em"])
        reasons[s.finish_reason or "unfinished"] += 1
        actions += len(s.infos)
        invalid += sum(not i.valid for i in s.infos)
        searches += s.n_searches
        redundant += redundant_searches(s)
        r = gold_recall(s)
        if r is not None:
            recalls.append(r)
    out: dict[str, Any] = {k: v / n for k, v in totals.items()}
    out.update(
        n=n,
        searches_per_question=searches / n,
        tokens_per_question=sum(s.generated_tokens for s in states) / n,
        invalid_action_rate=invalid / max(actions, 1),
        redundant_search_rate=redundant / max(searches, 1),
        finish_reasons=dict(sorted(reasons.items())),
        # hop counts come from the data's decompositions; without one (HotpotQA, FlashRAG files) it is unknown
        em_by_hops={
            str(h) if h else "unknown": sum(v) / len(v) for h, v in sorted(by_hops.items(), key=_hops_last)
        },
    )
    if recalls:
        out["gold_doc_recall"] = sum(recalls) / len(recalls)
        out["gold_recall_by_step"] = gold_recall_by_step(states)
    return out


def add_judge_metrics(
    metrics: dict[str, Any], states: Sequence[EnvState], judge: dict[str, Any] | None
) -> None:
    """With ``eval.judge`` set, the answer judge's columns (`searchrl.rewards.answer_judge.judge_accuracy`)."""
    if not judge:
        return
    from searchrl.rewards.answer_judge import AnswerJudge, judge_accuracy

    verdicts = AnswerJudge(**{"key": "eval.judge", **judge})
    metrics.update(
        judge_accuracy(verdicts, [(s.example.question, s.example.answers, s.answer) for s in states])
    )


def markdown_table(rows: dict[str, dict[str, Any]]) -> str:
    cols = [
        "n",
        "em",
        "f1",
        "sub_em",
        "judge_acc",
        "searches_per_question",
        "tokens_per_question",
        "invalid_action_rate",
        "gold_doc_recall",
    ]
    # the judge's column only when a judge was asked (`eval.judge`)
    cols = [c for c in cols if c != "judge_acc" or any("judge_acc" in m for m in rows.values())]
    lines = ["| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in rows.items():
        cells = [f"{m[c]:.3f}" if isinstance(m.get(c), float) else str(m.get(c, "")) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prediction(state: EnvState) -> dict[str, Any]:
    """One question's evaluation record: the answer and its scores, the search behaviour, the transcript."""
    ex = state.example
    gold = set(ex.gold_doc_ids)
    searches = state.searches()
    retrieved = [list(ids) for _, ids in searches]
    return {
        "id": ex.id,
        "question": ex.question,
        "answers": list(ex.answers),
        "prediction": state.answer,
        **answer_scores(state.answer, ex.answers),
        "searches": len(searches),
        "queries": [q for q, _ in searches],
        "invalid_actions": sum(not i.valid for i in state.infos),
        "finish_reason": state.finish_reason,
        "generated_tokens": state.generated_tokens,
        "retrieved": retrieved,  # document ids per search step
        # gold documents retrieved at some step (None: the data names none)
        "gold_hits": sorted(gold & {d for ids in retrieved for d in ids}) if gold else None,
        "gold_doc_ids": list(ex.gold_doc_ids),
        "hops": ex.n_hops or None,  # from the data's decomposition (None: unknown)
        "transcript": state.text(),
        "segments": transcript_segments(state),
    }


def transcript_segments(state: EnvState) -> list[dict[str, Any]]:
    """The transcript as the agent saw it, split into segments (what `searchrl view` draws): the prompt, then
    each action and the environment's observation, with the documents each search retrieved (the
    environment's own retrieval, ``prefetched``, on the prompt) and whether the data names them gold."""
    gold = set(state.example.gold_doc_ids)

    def docs(found: Any) -> list[dict[str, Any]]:
        return [{"id": d.id, "title": d.title, "text": d.text, "gold": d.id in gold} for d in found]

    prompt: dict[str, Any] = {"kind": "prompt", "text": state.prompt}
    if state.prefetched is not None:
        prompt["docs"] = docs(state.prefetched[1])
    out = [prompt]
    for i, (action, obs) in enumerate(zip(state.actions, state.observations)):
        info = state.infos[i] if i < len(state.infos) else None
        act: dict[str, Any] = {"kind": "action", "text": action}
        if info is not None:
            act.update(step=info.kind, valid=info.valid, error=info.error)
        out.append(act)
        seg: dict[str, Any] = {"kind": "observation", "text": obs}
        if i < len(state.retrieved) and state.retrieved[i]:
            seg["docs"] = docs(state.retrieved[i])
        if obs or "docs" in seg:
            out.append(seg)
    return out


def hotpot_predictions(states: Sequence[EnvState]) -> dict[str, Any]:
    """The official HotpotQA prediction file (`hotpot_evaluate_v1.py`): answers by id, no supporting facts."""
    return {"answer": {s.example.id: s.answer or "" for s in states}, "sp": {}}


def write_results(
    out_dir: str | Path, name: str, metrics: dict[str, Any], states: Sequence[EnvState] | None = None
) -> tuple[Path, Path]:
    """``NAME.json`` and ``NAME.md`` (the aggregates); with ``states``, ``NAME.predictions.jsonl`` (one
    record per question, `prediction`) and, for HotpotQA questions, ``NAME.hotpot.json`` for the official
    evaluation script."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    md.write_text(markdown_table({name: metrics}) + "\n", encoding="utf-8")
    if states is not None:
        with open(out / f"{name}.predictions.jsonl", "w", encoding="utf-8") as f:
            for s in states:
                f.write(json.dumps(prediction(s), ensure_ascii=False) + "\n")
        if states and all(s.example.metadata.get("format") == "hotpotqa" for s in states):
            (out / f"{name}.hotpot.json").write_text(json.dumps(hotpot_predictions(states)), encoding="utf-8")
    return js, md


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The records `write_results` wrote to a ``*.predictions.jsonl`` file."""
    from searchrl.data.example import read_jsonl

    return list(read_jsonl(path))


def run_policy(
    model_context: Any,
    tokenizer: Any,
    env: Any,
    examples: Sequence[Any],
    budget: RolloutConfig,
    temperature: float = 0.0,
    batch_size: int = 64,
) -> list[EnvState]:
    """Episodes of the policy on ``examples`` (greedy by default), through the shared rollout loop, within the
    token budgets of ``budget`` (the experiment's ``rollout`` section: ``max_new_tokens`` per action,
    ``max_total_tokens`` per episode)."""
    from searchrl.rollout.generator import SamplingParams
    from searchrl.rollout.hf import HFGenerator
    from searchrl.rollout.loop import rollout

    gen = HFGenerator(None, tokenizer, env.stop_strings, batch_size=batch_size, model_context=model_context)
    params = SamplingParams(temperature, 1.0, budget.max_new_tokens)
    trajs, _ = rollout(examples, env, gen, tokenizer, params, 1, budget.max_total_tokens)
    return [t.state for t in trajs]  # type: ignore[misc]


def run_best_of_n(
    policy: Any,
    tokenizer: Any,
    scorer: Any,
    env: Any,
    examples: Sequence[Any],
    n: int,
    budget: RolloutConfig,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[EnvState]:
    """PRM-guided inference (RAG-Gym Appendix D, Algorithm 1): at every step sample ``n`` actions from
    the same state, keep the one the PRM scores highest, step the environment with it (``budget``: the
    ``rollout`` section's token budgets)."""
    from contextlib import nullcontext

    from searchrl.rollout.generator import SamplingParams
    from searchrl.rollout.hf import HFGenerator
    from searchrl.rollout.loop import start_trajectories
    from searchrl.rollout.step_search import best, step_search

    gen = HFGenerator(
        None,
        tokenizer,
        env.stop_strings,
        batch_size=batch_size,
        model_context=lambda: nullcontext(policy),
    )
    params = SamplingParams(temperature, 1.0, budget.max_new_tokens)

    def score(pairs: list[tuple[Any, Any]]) -> list[float]:
        cands = [c for _, c in pairs]
        return scorer.score([c.state_ids() for c in cands], [c.action_ids() for c in cands]) if cands else []

    trajs = step_search(
        start_trajectories(env, tokenizer, examples),
        n,
        score,
        best,
        env,
        gen,
        tokenizer,
        params,
        budget.max_total_tokens,
    )
    return [t.episode for t in trajs]


def policy_agent(resources: Any, examples: Sequence[Any], model: str | None, label: str) -> list[EnvState]:
    """Greedy (``eval.temperature``) episodes of a policy: ``model``, else the run's trained model, else
    the experiment's model."""
    from contextlib import nullcontext

    from searchrl.app.resources import local_model_dir
    from searchrl.engine.checkpoint import has_weights
    from searchrl.models.load import load_model_and_tokenizer

    exp = resources.exp
    trained = exp.out / "final"
    path = model or (trained if has_weights(trained) else local_model_dir(resources))
    if model is None and not has_weights(trained):
        print(
            f"note: {trained} holds no trained model (train first, or pass --model DIR): evaluating the "
            "experiment's starting model instead"
        )
    print(f"evaluating the policy in {path} on {label}")
    policy, tokenizer = load_model_and_tokenizer(path, exp.model.dtype)
    r = exp.rollout
    return run_policy(
        lambda: nullcontext(policy),
        tokenizer,
        resources.env(),
        examples,
        r,
        exp.eval.temperature,
        r.batch_size,
    )


def teacher_agent(resources: Any, examples: Sequence[Any], model: str | None, label: str) -> list[EnvState]:
    """The scripted oracle of the synthetic world (an upper bound for the environment and retriever)."""
    from searchrl.envs.synthetic.teacher import run_teacher

    if resources.world is None:
        raise DataError("the teacher agent needs the synthetic world (data.source: synthetic)")
    return run_teacher(resources.env(), list(examples), resources.exp.teacher)


# `searchrl eval --agent NAME` (``eval.agent``): NAME -> fn(resources, examples, --model, label) -> episodes.
# PRM best-of-N (``prm``) returns one row per N and is run by the CLI itself.
EVAL_AGENTS = {"policy": policy_agent, "teacher": teacher_agent}
