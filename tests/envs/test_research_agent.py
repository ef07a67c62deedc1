"""RAG-Gym's ReSearch agent design: summaries of each search, the re-rendered state (eq. 8), the rollout
loop restarting from it, process data and best-of-N over it, and the configuration guard."""

from types import SimpleNamespace

import pytest

from searchrl.core.errors import ConfigError
from searchrl.core.records import Doc, Example
from searchrl.envs.search import SearchEnv
from searchrl.envs.summarize import NO_ANSWER, ExtractiveSummarizer
from searchrl.rollout.chat import LLMSummarizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.loop import encode, rollout
from tests.helpers import ScriptedCandidates

DOC = Doc(
    id="d1",
    title="Graitrekin",
    text="Graitrekin is a well-known singer. The birthplace of Graitrekin is "
    "Grouthzeis. Graitrekin founded Bithruium.",
)


class OneDoc:
    def search(self, queries, k):
        return [[DOC] for _ in queries]


EX = Example(id="q1", question="Where was Graitrekin born?", answers=("Grouthzeis",))


def test_extractive_summary_is_the_sentences_sharing_most_words_with_the_query():
    assert (
        ExtractiveSummarizer(1).one("Graitrekin birthplace", [DOC])
        == "The birthplace of Graitrekin is Grouthzeis."
    )
    # stems: "founder" meets "founded"; two sentences come back in document order
    two = ExtractiveSummarizer(2).one("Graitrekin founder", [DOC])
    assert two == "Graitrekin is a well-known singer. Graitrekin founded Bithruium."
    assert ExtractiveSummarizer().one("zzz qqq", [DOC]) == NO_ANSWER
    with pytest.raises(ValueError, match="max_sentences"):
        ExtractiveSummarizer(0)


def test_research_state_is_the_question_and_query_summary_pairs():
    env = SearchEnv(OneDoc(), template="short", topk=1, max_turns=3, agent="research")
    s = env.reset(EX)
    assert env.render(s) == s.prompt == "Question: Where was Graitrekin born?\n"
    obs, done, info = env.step(
        s, "<think> find the birthplace </think>\n<search> Graitrekin birthplace </search>"
    )
    assert info.valid and info.doc_ids == ("d1",) and not done
    assert "founded Bithruium" not in obs and "Grouthzeis" in obs  # the summary, not the document
    env.step(s, "no tags at all")  # invalid: it costs a turn but is not part of the state
    obs, done, _ = env.step(s, "<think> again </think><search> Graitrekin founder </search>")
    assert obs.endswith("<answer>") and not done  # the third turn used the budget: the answer is forced
    text = env.render(s)
    assert text == (
        "Question: Where was Graitrekin born?\n"
        "<search> Graitrekin birthplace </search>\n\n<information>Graitrekin is a well-known singer. "
        "The birthplace of Graitrekin is Grouthzeis.</information>\n\n"
        "<search> Graitrekin founder </search>\n\n<information>Graitrekin is a well-known singer. "
        "Graitrekin founded Bithruium.</information>\n\n<answer>"
    )
    assert "find the birthplace" not in text and "no tags" not in text  # earlier reasoning is dropped
    assert env.pieces(s) == (text, [], [])
    react = SearchEnv(OneDoc(), template="short", topk=1, agent="react")
    r = react.reset(EX)
    react.step(r, "<search> Graitrekin birthplace </search>")
    assert react.render(r) == r.text() and react.pieces(r) == (r.prompt, r.actions, r.observations)
    assert "Graitrekin founded Bithruium" in r.observations[0]  # react sees the whole document


def test_a_summarizer_on_react_summarises_its_observations():  # Search-o1's design
    env = SearchEnv(OneDoc(), template="short", topk=1, summarizer=ExtractiveSummarizer(1))
    s = env.reset(EX)
    obs, _, _ = env.step(s, "<search> Graitrekin birthplace </search>")
    assert obs == "\n\n<information>The birthplace of Graitrekin is Grouthzeis.</information>\n\n"
    assert env.append_only and env.render(s) == s.text()


def test_the_rollout_loop_restarts_each_turn_from_the_rendered_state(tiny_model_dir):
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(OneDoc(), template="short", topk=1, max_turns=3, agent="research")
    search = "<think> who </think>\n<search> Graitrekin birthplace </search>"
    answer = "<think> so </think>\n<answer> Grouthzeis </answer>"
    gen = ScriptedCandidates(tok, [[search], [answer]])
    [t], stats = rollout([EX], env, gen, tok, SamplingParams(1.0, 1.0, 32), 1, 2048)
    st = t.episode
    assert st.actions == [search, answer] and st.answer == "Grouthzeis" and stats.episodes == 1
    rendered = env.render(env.replay(EX, st.actions[:1], st.observations[:1]))
    assert "who" not in rendered
    assert gen.prompts[1] == [encode(tok, rendered)]  # turn 2 saw the re-rendered state, not the transcript
    # the trajectory holds the last (state, action): what best-of-N scores and SFT would train on
    assert [s.kind for s in t.segments] == ["prompt", "action"] and t.segments[0].token_ids == encode(
        tok, rendered
    )
    assert len(t.steps) == 1 and t.steps[0].segment == 1


def test_process_data_of_the_research_agent_is_one_record_per_step(tiny_model_dir, make_exp):
    from searchrl.app.process_data import collect
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(OneDoc(), template="short", topk=1, max_turns=3, agent="research")
    ex = Example(id="q1", question=EX.question, answers=EX.answers, hops=())
    good = "<think> a </think>\n<search> Graitrekin birthplace </search>"
    bad = "<think> a </think>\n<answer> nobody </answer>"
    right = "<think> b </think>\n<answer> Grouthzeis </answer>"

    def annotate(items):  # the executed candidates score 1, the others -1
        return [1.0 if it.action in (good, right) else -1.0 for it in items]

    import searchrl.app.process_data as pd

    exp = make_exp("process_data={n: 2, chosen_min: 1.0, rejected_max: -1.0}")
    resources = SimpleNamespace(exp=exp, env=lambda: env, examples=lambda split: [ex])
    orig = pd.ANNOTATORS
    pd.ANNOTATORS = SimpleNamespace(get=lambda name: lambda **kw: annotate)
    try:
        pairs, records, summary = collect(
            resources, ScriptedCandidates(tok, [[good, bad], [right, bad]]), tok, progress=False
        )
    finally:
        pd.ANNOTATORS = orig
    assert summary["kept_episodes"] == 1 and len(records) == 2 and len(pairs) == 2
    step2 = "Question: Where was Graitrekin born?\n<search> Graitrekin birthplace </search>"
    assert records[0]["prompt"] == "Question: Where was Graitrekin born?\n" and records[0]["actions"] == [
        good
    ]
    assert records[1]["prompt"].startswith(step2) and records[1]["actions"] == [right]
    assert records[1]["observations"] == [""] and "<think> a" not in records[1]["prompt"]
    assert [(p["prompt"], p["actions"], p["chosen"], p["rejected"]) for p in pairs] == [
        (records[0]["prompt"], [], good, bad),
        (records[1]["prompt"], [], right, bad),
    ]


def test_online_algorithms_refuse_the_research_agent_but_collection_accepts_it():
    from searchrl.app.experiment import check_arguments, load_experiment

    exp = load_experiment(None, ["env.agent=research", "algorithm={name: grpo}"])
    with pytest.raises(ConfigError, match="key 'env.agent'") as e:
        check_arguments(exp, "x.yaml")
    assert "re-renders its state" in str(e.value) and "react" in str(e.value)
    check_arguments(exp, "x.yaml", training=False)
    check_arguments(load_experiment(None, ["env.agent=research", "algorithm={name: dpo}"]), "x.yaml")
    with pytest.raises(ConfigError, match="env.summarizer.name"):
        load_experiment(None, ["env.summarizer={name: abstractive}"])
    bad = load_experiment(
        None, ["env.agent=research", "env.summarizer={name: extract, args: {sentences: 2}}"]
    )
    with pytest.raises(ConfigError, match="key 'env.summarizer.args.sentences'") as e:
        check_arguments(bad, "x.yaml")
    assert "max_sentences" in str(e.value)


def test_llm_summarizer_sends_figure_7_and_falls_back_when_a_request_fails(monkeypatch):
    with pytest.raises(ValueError, match="env.summarizer.model is required"):
        LLMSummarizer()
    sent = []

    class Client:
        def complete(self, convs, max_tokens, temperature):
            sent.extend(convs)
            return ["  Grouthzeis,\n per Doc 1. ", None]

    import searchrl.rollout.chat as chat

    monkeypatch.setattr(chat, "chat_client", lambda *a: Client())
    out = LLMSummarizer(model="m")([(EX.question, "Graitrekin birthplace", [DOC]), (EX.question, "x", [])])
    assert out == ["Grouthzeis, per Doc 1.", NO_ANSWER]
    prompt = sent[0][0]["content"]
    assert "### Follow-up Query\nGraitrekin birthplace" in prompt and "Doc 1(Title: Graitrekin)" in prompt
    assert f"Original question: {EX.question}" in prompt and "explicitly point this out" in prompt


def test_teacher_records_for_the_research_agent_are_the_states_it_sees(small_world, world_bm25):
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import run_teacher, teacher_records

    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=5, agent="research")
    exs = small_world.examples("train")[:6]
    cfg = TeacherConfig(noisy=False, rename_prob=0.0)
    recs = teacher_records(env, small_world, exs, cfg)
    live = []
    for st in run_teacher(env, exs, cfg):  # the same episodes stepped live: retrieval and summaries again
        s = env.reset(st.example)
        for a in st.actions:
            live.append((env.render(s), a))
            env.step(s, a)
    assert [(r["prompt"], *r["actions"]) for r in recs] == live
    assert any("<information>" in p for p, _ in live) and all(r["observations"] == [""] for r in recs)
    renamed = teacher_records(env, small_world, exs, TeacherConfig(noisy=False, rename_prob=1.0))
    assert all(r["prompt"].startswith(f"Question: {r['question']}") for r in renamed)
    assert {r["question"] for r in renamed}.isdisjoint(ex.question for ex in exs)


def test_the_llm_summarizer_counts_failed_requests():
    import socket

    from searchrl.core.serving import service_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    service_metrics()  # start counting from here
    summarize = LLMSummarizer(model="m", url=f"http://127.0.0.1:{port}/v1", timeout=1, retries=0)
    assert summarize([(EX.question, "q", [DOC]), (EX.question, "r", [DOC])]) == [NO_ANSWER, NO_ANSWER]
    m = service_metrics()
    assert (m["service/summarizer/requests"], m["service/summarizer/failures"]) == (2.0, 2.0)
    assert f"127.0.0.1:{port}" in summarize.client.counter.last_error
