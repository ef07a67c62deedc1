"""The 2026 search-agent pieces on the shared base: ZeroSearch's simulated search engine and its curriculum,
ParallelSearch's several queries per search and its reward, Search-R1++'s action penalties and REINFORCE
estimators; values hand-computed from the papers' formulas."""

import itertools
import math

import pytest
import torch

from searchrl.algorithms.advantage_estimators import AdvantageInput, reinforce, reinforce_batch
from searchrl.core.records import Doc, Example
from searchrl.core.types import Segment, Trajectory
from searchrl.envs.retrievers import build_retriever
from searchrl.envs.retrievers.simulated import (
    SimulatedRetriever,
    noise_probability,
    parse_documents,
)
from searchrl.envs.search import SearchEnv
from searchrl.rewards.outcome import action_penalty_reward, parallel_search_reward


# ------------------------------------------------------------------ ZeroSearch
def zerosearch_dynamic_threshold(i: int, m: int, p_s: float, p_e: float, b: float) -> float:
    """Written from ZeroSearch's released code (its ``dynamic_threshold``, called with verl's global step,
    counted from 1): p_s + (b^(i/m) - 1) / (b - 1) * (p_e - p_s)."""
    return p_s + (b ** (i / m) - 1) / (b - 1) * (p_e - p_s)


def test_noise_curriculum_is_zerosearchs_code():
    m = 100
    for step in (0, 1, 24, 49, 75, 98, 99):
        got = noise_probability(step, m, 0.0, 0.5, 4.0)
        assert got == pytest.approx(zerosearch_dynamic_threshold(step + 1, m, 0.0, 0.5, 4.0))
    assert noise_probability(m - 1, m, 0.0, 0.5, 4.0) == pytest.approx(0.5)  # the last step reaches p_e
    assert noise_probability(0, m, 0.0, 0.5, 4.0) < 0.003  # starts at p_s (the formula we had: 0.125)
    assert noise_probability(49, m, 0.0, 0.5, 4.0) == pytest.approx(0.5 / 3)  # i/m = 1/2: 0.167 (had 0.25)
    assert noise_probability(25, 100, 0.1, 0.9, 2.0) == pytest.approx(
        zerosearch_dynamic_threshold(26, 100, 0.1, 0.9, 2.0)
    )
    assert noise_probability(4, 10, 0.1, 0.9, 1.0) == pytest.approx(0.1 + 0.5 * 0.8)  # b = 1: linear
    assert noise_probability(500, 10, 0.1, 0.9, 4.0) == pytest.approx(0.9)  # past the end: held at p_e
    ps = [noise_probability(i, 60, 0.0, 0.75, 4.0) for i in range(60)]
    assert all(a < b for a, b in itertools.pairwise(ps))  # rises every step


def test_simulated_corpus_source_serves_useful_or_noisy_documents(small_world):
    docs = small_world.documents()
    exact = build_retriever("bm25", corpus=docs)
    sim = build_retriever("simulated", corpus=docs, p_start=0.0, p_end=1.0, base=4.0, seed=1)
    assert isinstance(sim, SimulatedRetriever)  # never wrapped in the cache
    ex = small_world.examples("train")[0]
    q = ex.hops[0].keys[0]
    useful = exact.search([q], 3)[0]
    sim.set_progress(0, 10**9)  # p ≈ p_s
    sim.p_end = 0.0
    assert [d.id for d in sim.search([q], 3)[0]] == [d.id for d in useful]
    sim.p_end = 1.0
    sim.set_progress(10, 10)  # p = 1: every query noisy
    noisy = sim.search([q, q], 3)
    deeper = {d.id for d in exact.search([q], 12)[0][3:]}
    for got in noisy:
        assert len(got) == 3 and {d.id for d in got} <= deeper  # on topic, never the top k
    sim.set_progress(None)  # outside training: exactly the base retriever
    assert sim.noise == 0.0 and [[d.id for d in g] for g in sim.search([q], 3)] == [[d.id for d in useful]]
    sim.set_progress(10, 10)
    # the same step draws the same again (resume), another step may not
    again = SimulatedRetriever(docs, p_end=1.0, seed=1)
    again.set_progress(10, 10)
    assert [[d.id for d in g] for g in again.search([q, q], 3)] == [[d.id for d in g] for g in noisy]


def test_simulated_noise_rate_follows_the_curriculum(small_world):
    sim = SimulatedRetriever(small_world.documents(), p_start=0.0, p_end=0.8, seed=0)
    q = small_world.examples("train")[0].hops[0].keys[0]
    for step, total in ((0, 100), (100, 100)):
        sim.set_progress(step, total)
        sim.served = sim.noisy_served = 0
        sim.search([q] * 400, 1)
        p = noise_probability(step, total, 0.0, 0.8, 4.0)
        assert abs(sim.noisy_served / 400 - p) < 4 * math.sqrt(p * (1 - p) / 400)


def test_the_run_builds_the_simulators_client(tmp_path):
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.core.errors import DataError
    from searchrl.rollout.chat import OpenAIChatClient

    llm = "{model: sim, url: 'http://127.0.0.1:9/v1', api_key_env: null}"
    exp = load_experiment(None, [f"env.retriever={{name: simulated, args: {{source: llm, llm: {llm}}}}}"])
    sim = Resources(exp).retriever
    assert isinstance(sim, SimulatedRetriever) and isinstance(sim.client, OpenAIChatClient)
    bad = load_experiment(None, ["env.retriever={name: simulated, args: {source: llm, llm: {modle: x}}}"])
    with pytest.raises(DataError, match=r"env.retriever.args.llm: unknown key\(s\) modle"):
        _ = Resources(bad).retriever
    with pytest.raises(DataError, match="needs a chat client"):
        SimulatedRetriever(source="llm")


def test_parse_simulated_documents():
    text = "Doc 1: Paris | Paris is the capital of France.\nDoc 2: Lyon | A city.\nDoc 3: x | y"
    got = parse_documents(text, "capital of france", 2)
    assert [(d.title, d.text) for d in got] == [
        ("Paris", "Paris is the capital of France."),
        ("Lyon", "A city."),
    ]
    assert got[0].id.startswith("sim-") and got[0].id != got[1].id
    [one] = parse_documents("just some text\nover lines", "q", 3)  # no Doc lines: one document
    assert one.title == "q" and one.text == "just some text over lines"
    assert parse_documents(None, "q", 3) == [] and parse_documents("  ", "q", 3) == []
    assert parse_documents("Doc 1: \udfff | \x00", "q", 1)[0].id.startswith("sim-")  # any text, no raise


def test_simulated_llm_source_against_a_scripted_model():
    seen = []

    class Client:
        def complete(self, convs, max_tokens, temperature):
            seen.extend(c[-1]["content"] for c in convs)
            return [
                "Doc 1: T | useful text" if "holding facts" in c[-1]["content"] else "noise" for c in convs
            ]

    sim = SimulatedRetriever(source="llm", llm={"model": "m"}, client=Client(), p_start=0.0, p_end=0.0)
    env = SearchEnv(sim, topk=1)
    ex = Example(id="1", question="Capital of France?", answers=("Paris",))
    sim.set_progress(3, 10)  # a training step
    st = env.reset(ex)
    obs, _, info = env.step(st, "<search> france capital </search>")
    assert "useful text" in obs and info.doc_ids == (st.retrieved[-1][0].id,)
    assert "Capital of France?" in seen[0] and "Paris" in seen[0]  # the question and its answer (ZeroSearch)
    sim.set_progress(None)  # evaluation: no hints
    env.step(env.reset(ex), "<search> france capital </search>")
    assert "Paris" not in seen[1] and "Capital of France?" not in seen[1]


def test_simulated_retriever_in_training_logs_the_curriculum(make_exp):
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    exp = make_exp("env.retriever={name: simulated, args: {p_start: 0.0, p_end: 0.6}}")
    tr = trainer_for(exp, "grpo", TrainerConfig(steps=2, batch_size=2, micro_batch_size=4, save_every=2))
    tr.run()
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["search/noise_p"] for r in rows] == pytest.approx(
        [noise_probability(i, 2, 0.0, 0.6, 4.0) for i in range(2)]
    )


# ------------------------------------------------------------------ ParallelSearch
class Echo:
    def __init__(self):
        self.calls = []

    def search(self, queries, k):
        self.calls.append(list(queries))
        return [[Doc(id=f"{q}#{i}", title=q, text=f"about {q}") for i in range(k)] for q in queries]


EX = Example(id="c", question="Who is older, A or B?", answers=("A",), metadata={"type": "comparison"})
CHAIN = Example(id="b", question="Where was A's father born?", answers=("X",), metadata={"type": "bridge"})


def run(actions, ex=EX, sep="##"):
    env = SearchEnv(Echo(), topk=1, query_separator=sep, max_turns=5)
    st = env.reset(ex)
    for a in actions:
        env.step(st, a)
    return env, Trajectory(ex, [Segment("prompt", [1])], state=st)


def test_several_queries_in_one_search_are_one_batch_shown_per_query():
    env, t = run(["<search> A born ## B born </search>", "<answer> A </answer>"])
    assert env.retriever.calls == [["A born", "B born"]]
    info = t.state.infos[0]
    assert info.queries == ("A born", "B born") and info.doc_ids == ("A born#0", "B born#0")
    obs = t.state.observations[0]
    assert obs.index("Query 1: A born") < obs.index("about A born") < obs.index("Query 2: B born")
    assert [d.id for d in t.state.retrieved[0]] == ["A born#0", "B born#0"]


@pytest.mark.parametrize(
    "query, error",
    [
        ("a##b##c##d##e", "too_many_queries"),
        ("## ##", "empty_query"),
        ("##" * 200_000, "empty_query"),
        ("a##" * 200_000, "too_many_queries"),
        ("a##" + "x" * 300, "query_too_long"),
    ],
)
def test_hostile_parallel_searches_are_invalid_actions(query, error):
    env = SearchEnv(Echo(), query_separator="##")
    info = env.parse(f"<search>{query}</search>")
    assert (info.kind, info.valid, info.error) == ("invalid", False, error)


def test_parallel_search_reward_by_hand():
    # comparison question, one round of 2 queries, correct: 1 + 0.2·1 + 0.2·(1 - 1/2) = 1.3
    _, t = run(["<search> A born ## B born </search>", "<answer> A </answer>"])
    out = parallel_search_reward(t, answers=EX.answers, metadata=EX.metadata)
    assert out.score == pytest.approx(1.3) and out.metrics["decomposition"] == 1.0
    # the same questions asked one per round: r_d = 0, r_s = 1 - 2/2 = 0
    _, t = run(["<search> A born </search>", "<search> B born </search>", "<answer> A </answer>"])
    assert parallel_search_reward(t, answers=EX.answers, metadata=EX.metadata).score == pytest.approx(1.0)
    # wrong answer: the terms are gated off (only_if_correct), or counted without the gate
    _, t = run(["<search> A born ## B born </search>", "<answer> B </answer>"])
    assert parallel_search_reward(t, answers=EX.answers, metadata=EX.metadata).score == 0.0
    ungated = parallel_search_reward(t, answers=EX.answers, metadata=EX.metadata, only_if_correct=False)
    assert ungated.score == pytest.approx(0.3)
    # a chain question split in parallel: needless decomposition, 1 - 0.2 + 0.2·0.5 = 0.9
    _, t = run(["<search> A father ## X born </search>", "<answer> X </answer>"], ex=CHAIN)
    assert parallel_search_reward(t, answers=CHAIN.answers, metadata=CHAIN.metadata).score == pytest.approx(
        0.9
    )
    off = parallel_search_reward(t, answers=CHAIN.answers, metadata=CHAIN.metadata, penalise_needless=False)
    assert off.score == pytest.approx(1.1)


# ------------------------------------------------------------------ Search-R1++
def test_action_penalties_by_hand():
    _, t = run(["nonsense", "<search> a </search>", "<answer> A </answer>"])
    assert action_penalty_reward(t).score == pytest.approx(-0.1)  # one invalid action, answered
    assert action_penalty_reward(t, per_search=0.05).score == pytest.approx(-0.15)
    _, t = run(["nonsense", "more nonsense", "<search> a </search>"])  # never answered
    assert action_penalty_reward(t).score == pytest.approx(-0.2 - 0.2)
    assert action_penalty_reward(t, max_invalid=1).score == pytest.approx(-0.2 - 0.1)
    assert action_penalty_reward(t, no_answer=0.0, invalid=0.0).score == 0.0  # every term a switch


def test_reinforce_estimators_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.float32)
    x = AdvantageInput(rewards, torch.tensor([0, 0, 1, 1]), mask, None, cfg=None)
    assert torch.equal(reinforce(x), rewards[:, None] * mask)  # A = r, no baseline
    # batch mean 0.5: A = r - 0.5 on every action token
    assert torch.allclose(reinforce_batch(x), (rewards - 0.5)[:, None] * mask)
    # over two processes the mean is the union's: this half sees [1, 0, .5, .5], the other [0, 0, 0, 0]
    other_sum, other_n = 0.0, 4.0
    totals = iter([4.0 + other_n, 2.0 + other_sum])
    x2 = AdvantageInput(rewards, x.group_ids, mask, None, cfg=None, sum_all=lambda v: next(totals))
    assert torch.allclose(reinforce_batch(x2), (rewards - 0.25)[:, None] * mask)


def test_reinforce_batch_leaves_the_trainers_padding_rows_out():
    """The issue's case, written from verl's batch mean over real rows: rewards [1, 0, 1, 1] and 4 padding
    rows (negative group ids, no loss tokens) give A = r − 0.75, not r − 0.375."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, -1, -2, -3, -4])
    mask = torch.cat([torch.ones(4, 2), torch.zeros(4, 2)])
    adv = reinforce_batch(AdvantageInput(rewards, groups, mask, None, cfg=None))
    assert torch.allclose(adv[:, 0], torch.tensor([0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]))
    assert torch.equal(adv[4:], torch.zeros(4, 2))


def test_reinforce_trains_with_groups_of_one():
    from searchrl.algorithms.grpo import GRPOConfig

    GRPOConfig(group_size=1, advantage="reinforce")
    GRPOConfig(group_size=1, advantage="reinforce_batch")
    with pytest.raises(ValueError, match="need no group"):
        GRPOConfig(group_size=1, advantage="rloo")


# ------------------------------------------------------------------ s3
LIBRARY = {
    "paris": Doc(id="p", title="Paris", text="Paris is the capital of France."),
    "france": Doc(id="f", title="France", text="France is a country in Europe."),
    "lyon": Doc(id="l", title="Lyon", text="Lyon is a city."),
}


class Library:
    """A retriever over fixed documents: the query's words pick them."""

    def search(self, queries, k):
        return [[d for w, d in LIBRARY.items() if w in q.lower()][:k] or [LIBRARY["lyon"]] for q in queries]


FR = Example(id="fr", question="What is the capital of France?", answers=("Paris",))


def searched(actions, ex=FR):
    env = SearchEnv(Library(), topk=3, max_turns=4)
    st = env.reset(ex)
    for a in actions:
        env.step(st, a)
    return Trajectory(ex, [Segment("prompt", [1])], state=st)


def test_gain_beyond_rag_by_hand_with_the_answer_in_documents_reader():
    from searchrl.rewards.gbr import GainBeyondRAG, selected_documents

    gbr = GainBeyondRAG(rag_k=1, keep=1)
    gbr.resources = {"retriever": Library}
    # D_RAG for the question itself: "france" matches France's document only, which lacks "Paris": Acc 0
    found = searched(["<search> paris france </search>", "<answer> x </answer>"])
    assert [d.id for d in selected_documents(found, keep=1, max_docs=9)] == ["p"]
    missed = searched(["<search> lyon </search>", "<answer> Paris </answer>"])  # its own answer is ignored
    a, b = gbr([found, missed])
    assert (a.score, a.metrics["acc_selected"], a.metrics["acc_rag"]) == (1.0, 1.0, 0.0)  # 1 - 0
    assert (b.score, b.metrics["acc_selected"]) == (0.0, 0.0)  # 0 - 0
    # keep 2 of each search, no repeats, at most max_docs
    two = searched(["<search> paris france </search>", "<search> france paris </search>"])
    assert [d.id for d in selected_documents(two, keep=2, max_docs=9)] == ["p", "f"]
    assert [d.id for d in selected_documents(two, keep=2, max_docs=1)] == ["p"]


def test_gain_beyond_rag_with_a_frozen_generator_and_judge():
    from searchrl.rewards.gbr import GainBeyondRAG

    class Generator:  # answers "Paris" when Paris's document is among its documents, else "Lyon"
        def complete(self, convs, max_tokens, temperature):
            return ["Paris" if "Paris is the capital" in c[-1]["content"] else "Lyon" for c in convs]

    gbr = GainBeyondRAG(rag_k=3, keep=3)
    gbr.client = Generator()
    gbr.resources = {"retriever": Library}
    plain = Example(id="p", question="capital of paris land", answers=("Paris",))  # RAG already finds it
    found = searched(["<search> paris </search>", "<answer> x </answer>"], ex=plain)
    [out] = gbr([found])
    assert (out.score, out.metrics["acc_rag"]) == (0.0, 1.0)  # no gain over what RAG gets: 1 - 1
    assert gbr.rag_answers([plain, FR]) == [True, False]  # the questions s3 would drop from training


def test_gbr_needs_the_runs_retriever():
    from searchrl.core.errors import DataError
    from searchrl.rewards.gbr import GainBeyondRAG

    with pytest.raises(DataError, match="needs the run's retriever"):
        GainBeyondRAG()([searched(["<answer> x </answer>"])])


def test_s3_trains_through_the_pipeline(make_exp):
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    exp = make_exp("rewards=[{name: gbr, args: {rag_k: 1, keep: 1}}]", "env.topk=1")
    tr = trainer_for(exp, "grpo", TrainerConfig(steps=1, batch_size=2, micro_batch_size=4, save_every=1))
    tr.run()
    row = read_metrics(exp.out / "metrics.jsonl")[-1]
    assert 0.0 <= row["reward/gbr/acc_rag"] <= 1.0 and -1.0 <= row["reward/mean"] <= 1.0
