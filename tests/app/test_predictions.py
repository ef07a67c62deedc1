"""Per-question predictions: every evaluation writes them beside its aggregates, and for HotpotQA questions
the official prediction file, which the official script scores as we do."""

import json
from pathlib import Path

from searchrl.app.eval_episodes import episode_metrics, read_predictions, write_results
from searchrl.core.types import EnvState, StepInfo
from searchrl.data.loaders import load_examples
from tests.helpers import eval_teacher
from tests.hotpot_official import evaluate as official_hotpot_eval

FIELDS = {
    "id",
    "question",
    "answers",
    "prediction",
    "em",
    "f1",
    "sub_em",
    "searches",
    "queries",
    "invalid_actions",
    "finish_reason",
    "generated_tokens",
    "retrieved",
    "gold_hits",
    "gold_doc_ids",
    "hops",
    "transcript",
    "segments",
}


def answered(ex, answer: str | None, searched: tuple[str, ...] = ()) -> EnvState:
    st = EnvState(example=ex, prompt=f"Question: {ex.question}\n")
    if searched:
        st.infos.append(StepInfo(kind="search", valid=True, query="q", doc_ids=searched))
        st.actions.append("<search>q</search>")
        st.observations.append("<information>…</information>")
    if answer is not None:
        st.infos.append(StepInfo(kind="answer", valid=True, answer=answer))
        st.actions.append(f"<answer>{answer}</answer>")
        st.observations.append("")
    st.done, st.finish_reason = True, "answer" if answer is not None else "budget"
    return st


def hotpot_file(tmp_path: Path, fixtures: Path, n: int = 12) -> Path:
    """A HotpotQA-format file of ``n`` questions from the fixture's two (ids and answers varied)."""
    rows = json.loads((fixtures / "hotpotqa.json").read_text())
    golds = ["Springfield", "yes", "no", "the Beatles", "1969", "New York City"]
    out = [dict(rows[i % 2], _id=f"hp{i}", answer=golds[i % len(golds)]) for i in range(n)]
    path = tmp_path / "hotpot.json"
    path.write_text(json.dumps(out))
    return path


def test_hotpot_prediction_file_scores_the_same_under_the_official_script(tmp_path, fixtures):
    gold_path = hotpot_file(tmp_path, fixtures)
    examples = load_examples(gold_path)
    # exact, case/article/punctuation variants, partial overlap, yes/no mismatches, no answer at all
    answers = [
        "Springfield",
        "No",
        "no",
        "Beatles!",
        "in 1969",
        "New York",
        None,
        "yes",
        "No.",
        "The Beatles",
    ]
    answers += ["1969 1969", "york new city"]
    states = [
        answered(ex, a, ("d1", "d2") if i % 3 == 0 else ())
        for i, (ex, a) in enumerate(zip(examples, answers))
    ]
    m = episode_metrics(states)
    write_results(tmp_path / "eval", "r", m, states)
    official = official_hotpot_eval(tmp_path / "eval" / "r.hotpot.json", gold_path)
    assert 0 < m["em"] < 1 and 0 < m["f1"] < 1
    assert abs(official["em"] - m["em"]) < 1e-12 and abs(official["f1"] - m["f1"]) < 1e-12
    preds = read_predictions(tmp_path / "eval" / "r.predictions.jsonl")
    assert [p["id"] for p in preds] == [ex.id for ex in examples] and set(preds[0]) == FIELDS
    assert preds[6]["prediction"] is None and preds[6]["em"] == 0.0 and preds[6]["finish_reason"] == "budget"
    assert (
        preds[0]["retrieved"] == [["d1", "d2"]] and preds[0]["searches"] == 1 and preds[1]["retrieved"] == []
    )
    assert "<answer>Springfield</answer>" in preds[0]["transcript"]


def test_the_real_hotpot_sample_scores_the_same_under_the_official_script(tmp_path, shared_data):
    gold_path = shared_data / "hotpotqa" / "hipporag_hotpotqa_train_100.json"
    examples = load_examples(gold_path)
    # a mix: the gold answer for every third question, a word of it for others, "yes" and nothing for the rest
    picks = [
        ex.answers[0] if i % 3 == 0 else ex.answers[0].split()[-1] if i % 3 == 1 else "yes"
        for i, ex in enumerate(examples)
    ]
    states = [answered(ex, None if i % 7 == 6 else a) for i, (ex, a) in enumerate(zip(examples, picks))]
    m = episode_metrics(states)
    write_results(tmp_path, "r", m, states)
    official = official_hotpot_eval(tmp_path / "r.hotpot.json", gold_path)
    assert abs(official["em"] - m["em"]) < 1e-12 and abs(official["f1"] - m["f1"]) < 1e-12


def test_eval_writes_predictions_that_recompute_the_aggregates(tmp_path, capsys):
    out = tmp_path / "run"
    eval_teacher(out, "env.topk=2", "data.world.questions=[100, 30, 40]")
    capsys.readouterr()
    metrics = json.loads((out / "eval-teacher-test.json").read_text())
    preds = read_predictions(out / "eval-teacher-test.predictions.jsonl")
    assert len(preds) == metrics["n"] == 40 and all(set(p) == FIELDS for p in preds)
    for key in ("em", "f1", "sub_em"):
        assert abs(sum(p[key] for p in preds) / len(preds) - metrics[key]) < 1e-12
    assert abs(sum(p["searches"] for p in preds) / 40 - metrics["searches_per_question"]) < 1e-12
    recall = [len(p["gold_hits"]) / len(p["gold_doc_ids"]) for p in preds if p["gold_doc_ids"]]
    assert abs(sum(recall) / len(recall) - metrics["gold_doc_recall"]) < 1e-12
    assert 0 < metrics["em"] < 1  # the noisy teacher: right and wrong answers both appear
    assert not (out / "eval-teacher-test.hotpot.json").exists()  # synthetic questions: no HotpotQA file
