"""StepSearch's equations on a hand-built 3-round episode (values computed by hand below)."""

import math

import pytest

from searchrl.core.records import Doc, Example, Hop
from searchrl.core.types import EnvState, Segment, Step, StepInfo, Trajectory
from searchrl.rewards.stepsearch import (
    TfIdf,
    information_gains,
    redundancy_penalties,
    search_key_reward,
    stepsearch_reward,
)

G1, G2 = Doc("g1", "Alpha", "alpha beta"), Doc("g2", "Gamma", "gamma delta")
U, HALF = Doc("u", "Other", "omega"), Doc("h", "Alpha", "alpha zeta")
DOCS = {d.id: d for d in (G1, G2, U, HALF)}
HOPS = (
    Hop("Who is alpha?", "b", gold_doc_id="g1", keys=("alpha beta", "alpha")),
    Hop("Where is b?", "Paris", gold_doc_id="g2", keys=("gamma delta",)),
)


def episode(rounds, queries, answer="Paris", think=True, bad_tag=False):
    """Search rounds (retrieved docs) then an answer, as the env would record them."""
    ex = Example("q", "Q?", ("Paris",), HOPS)
    state = EnvState(ex, "prompt ")
    traj = Trajectory(ex, [Segment("prompt", [0])], state=state)
    pos = 1
    for docs, q in zip(rounds, queries):
        info = StepInfo("search", True, query=q, doc_ids=tuple(d.id for d in docs))
        action = ("<think> t </think>" if think else "") + f"<search> {q} </search>"
        obs = "<information>" + " ".join(d.text for d in docs) + "</information>"
        state.actions.append(action), state.observations.append(obs), state.infos.append(info)
        state.retrieved.append(list(docs))
        traj.segments += [Segment("action", [1, 2]), Segment("observation", [3])]
        traj.steps.append(Step(len(traj.segments) - 2, pos + 1, info))
        pos += 3
    info = StepInfo("answer", True, answer=answer)
    state.actions.append(f"<think> t </think><answer> {answer} </answer>" + ("<search>" if bad_tag else ""))
    state.observations.append(""), state.infos.append(info), state.retrieved.append([])
    traj.segments.append(Segment("action", [4]))
    traj.steps.append(Step(len(traj.segments) - 1, pos, info))
    state.done = True
    return traj


def tfidf_cos_alpha_beta_vs_alpha_zeta():
    """By hand: the corpus's contents are '"Title"\\ntext'; document frequencies over the 4 docs."""
    n = 4
    idf = lambda df: math.log((1 + n) / (1 + df)) + 1  # noqa: E731
    # "alpha" appears in g1 and h (title and text: df 2), "beta" in g1 (1), "zeta" in h (1)
    a, b, z = idf(2), idf(1), idf(1)
    # g1 = '"Alpha" alpha beta' -> alpha tf 2, beta 1; h = '"Alpha" alpha zeta' -> alpha 2, zeta 1
    return (2 * a * 2 * a) / (math.sqrt((2 * a) ** 2 + b**2) * math.sqrt((2 * a) ** 2 + z**2))


ROUNDS = [[HALF, U], [HALF, U], [G1, G2]]
QUERIES = ["alpha beta", "foo", "gamma"]


def test_each_equation_by_hand():
    c = tfidf_cos_alpha_beta_vs_alpha_zeta()
    tf = TfIdf([d.contents for d in DOCS.values()])
    gains = information_gains([[d.contents for d in r] for r in ROUNDS], [G1.contents, G2.contents], tf)
    # round 1: c = (c_h, 0) -> G = c/2, memory (c, 0); round 2: nothing new -> 0;
    # round 3: c = (1, 1) -> G = ((1 - c) + 1) / 2
    assert gains == pytest.approx([c / 2, 0.0, (2 - c) / 2])
    assert redundancy_penalties([[d.id for d in r] for r in ROUNDS]) == [0.0, 1.0, 0.0]
    # r_key: sub-question 1: F1("alpha beta", "alpha beta") = 1; sub-question 2: best query "gamma" vs
    # "gamma delta": P = 1, R = 1/2 -> 2/3. Mean 5/6.
    assert search_key_reward(QUERIES, HOPS) == pytest.approx(5 / 6)


def test_the_reward_places_global_and_step_scores():
    c = tfidf_cos_alpha_beta_vs_alpha_zeta()
    t = episode(ROUNDS, QUERIES)
    out = stepsearch_reward(t, answers=("Paris",), hops=HOPS, example=t.example, docs=DOCS, gamma_key=0.5)
    assert out.score == pytest.approx(1.0 + 0.5 * 5 / 6)  # r_answer + γ_key r_key (eq. 6)
    assert out.step_scores == pytest.approx((c / 2, 0.0 - 1.0, (2 - c) / 2, 0.0))  # eq. 7, answer step 0
    assert out.metrics["redundant_searches"] == 1.0


def test_format_is_a_hard_constraint():
    for t in (episode(ROUNDS, QUERIES, think=True, bad_tag=True), episode([], [], answer="Paris")):
        out = stepsearch_reward(t, answers=("Paris",), hops=HOPS, example=t.example, docs=DOCS)
        assert out.score == 0.0 and all(s == 0.0 for s in out.step_scores) and out.metrics["format_ok"] == 0


@pytest.mark.parametrize(
    "flags,uses_gain,uses_pen,uses_key",
    [
        ({}, 1, 1, 1),
        ({"information_gain": False}, 0, 1, 1),
        ({"redundancy_penalty": False}, 1, 0, 1),
        ({"information_gain": False, "redundancy_penalty": False}, 0, 0, 1),
        ({"search_key": False}, 1, 1, 0),
    ],
)
def test_ablation_switches(flags, uses_gain, uses_pen, uses_key):
    c = tfidf_cos_alpha_beta_vs_alpha_zeta()
    t = episode(ROUNDS, QUERIES)
    out = stepsearch_reward(
        t, answers=("Paris",), hops=HOPS, example=t.example, docs=DOCS, gamma_key=0.5, **flags
    )
    gains, pens = [c / 2, 0.0, (2 - c) / 2], [0.0, 1.0, 0.0]
    expected = [uses_gain * g - uses_pen * p for g, p in zip(gains, pens)] + [0.0]
    assert out.step_scores == pytest.approx(tuple(expected))
    assert out.score == pytest.approx(1.0 + uses_key * 0.5 * 5 / 6)


def test_a_missing_corpus_is_a_clear_error():
    t = episode(ROUNDS, QUERIES)
    with pytest.raises(ValueError, match="needs the corpus"):
        stepsearch_reward(t, answers=("Paris",), hops=HOPS, example=t.example, docs=None)
