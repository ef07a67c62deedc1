import random

from searchrl.app.eval_episodes import episode_metrics
from searchrl.core.answers import exact_match
from searchrl.core.config import TeacherConfig
from searchrl.envs.search import SearchEnv
from searchrl.envs.synthetic.teacher import run_teacher, teacher_records, vague_query


def test_clean_teacher_reaches_em_095_on_test_with_bm25(world_bm25, small_world):
    """Acceptance: the clean teacher replayed through SearchEnv with BM25 reaches EM >= 0.95 on test."""
    for tags in ("search_r1", "research"):
        env = SearchEnv(world_bm25, tags=tags, template="short", topk=3, max_turns=6)
        states = run_teacher(env, small_world.examples("test"), TeacherConfig())
        m = episode_metrics(states)
        assert m["em"] >= 0.95, m
        assert m["invalid_action_rate"] == 0.0
        for s in states:
            assert all(i.valid for i in s.infos)


def test_noisy_teacher_makes_each_kind_of_mistake(world_bm25, small_world):
    env = SearchEnv(world_bm25, template="short", topk=3, max_turns=8)
    examples = [e for e in small_world.examples("train") if e.n_hops >= 2][:200]
    clean = episode_metrics(run_teacher(env, examples, TeacherConfig()))
    noisy_states = run_teacher(
        env, examples, TeacherConfig(noisy=True, p_repeat=0.5, p_early=0.3, p_vague=0.5)
    )
    noisy = episode_metrics(noisy_states)
    assert noisy["em"] < clean["em"] - 0.1  # answering early costs accuracy
    assert noisy["redundant_search_rate"] > clean["redundant_search_rate"] + 0.1  # repeats
    queries = [i.query for s in noisy_states for i in s.infos if i.kind == "search"]
    assert any(q == vague_query(h.question) for e in examples for h in e.hops for q in queries[:400])


def test_teacher_only_states_answers_it_retrieved(small_world):
    class EmptyRetriever:
        def search(self, queries, k):
            return [[] for _ in queries]

    env = SearchEnv(EmptyRetriever(), template="short", max_turns=6)
    states = run_teacher(env, small_world.examples("test")[:20], TeacherConfig())
    assert all(s.answer == "unknown" for s in states)  # gives up honestly after its keys fail
    assert all(s.n_searches == len(s.example.hops[0].keys) for s in states)


def test_budget_forced_answer(world_bm25, small_world):
    env = SearchEnv(world_bm25, template="short", max_turns=1)
    ex = [e for e in small_world.examples("test") if e.n_hops == 3][:10]
    states = run_teacher(env, ex, TeacherConfig())
    for s in states:
        assert s.infos[-1].forced and s.finish_reason == "answer"
        assert s.answer == s.example.hops[0].answer  # best it had when the budget ran out


def test_renamed_records_are_self_consistent(world_bm25, small_world):
    env = SearchEnv(world_bm25, template="short", topk=3, max_turns=6)
    examples = small_world.examples("train")[:30]
    recs = teacher_records(env, small_world, examples, TeacherConfig(rename_prob=1.0, seed=3))
    for rec, ex in zip(recs, examples):
        assert rec["renamed"]
        assert exact_match(rec["answer"], rec["answers"]) == 1.0  # the renamed answer matches renamed gold
        assert rec["answers"][0] != ex.answers[0]
        full = rec["prompt"] + "".join(a + o for a, o in zip(rec["actions"], rec["observations"]))
        # every name the renamed answer uses was read in a retrieved document
        assert rec["answers"][0].split()[0] in "".join(rec["observations"])
        assert ex.answers[0].split()[0] not in full
    plain = teacher_records(env, small_world, examples, TeacherConfig(rename_prob=0.0))
    assert not any(r["renamed"] for r in plain)
    rng = random.Random(0)
    assert rng  # deterministic seeds: the same config gives the same records
    assert teacher_records(env, small_world, examples, TeacherConfig(rename_prob=1.0, seed=3)) == recs


def test_quoting_teacher_cites_the_sentence_it_read(world_bm25, small_world):
    """teacher.quote: each sub-answer is stated with the retrieved sentence that names it, and the final
    thought quotes the last one before the answer; the actions taken are the same as without quoting."""
    import re

    env = SearchEnv(world_bm25, template="short", topk=3, max_turns=6)
    examples = small_world.examples("test")[:40]
    plain = run_teacher(env, examples, TeacherConfig())
    quoted = run_teacher(env, examples, TeacherConfig(quote=True))
    searches = 0
    for ex, p, q in zip(examples, plain, quoted):
        assert [i.query for i in p.infos] == [i.query for i in q.infos] and p.answer == q.answer
        for action, obs_before in zip(q.actions[1:], q.observations):
            m = re.search(r"Found: ([^<]*?)\.(?: Next| So| Let|\s*</think>)", action)
            if m:
                searches += 1
                assert f"{m.group(1)}." in obs_before, action  # a sentence of what was retrieved
                assert any(re.search(rf"\b{h.answer}\b", m.group(1)) for h in ex.hops), action
        if q.answer and q.finish_reason == "answer" and "Found:" in q.actions[-1]:
            assert q.actions[-1].index("Found:") < q.actions[-1].index("So the answer is")
    assert searches >= 40


def test_planning_teacher_states_the_searches_left_in_every_thought(world_bm25, small_world):
    """teacher.plan: every thought says how many hops are still unsolved ("Steps left: N."), counted from the
    decomposition: N hops before the first search, one fewer after each sub-answer found, 0 when the answer
    is right; an early answer (the noisy teacher's mistake) says a step is left. Same episodes as without."""
    import re

    env = SearchEnv(world_bm25, template="short", topk=3, max_turns=6)
    examples = [e for e in small_world.examples("train") if e.n_hops >= 2][:60] + small_world.examples(
        "test"
    )[:20]
    noisy = dict(noisy=True, p_repeat=0.15, p_early=0.6, p_vague=0.15, quote=True)
    plain = run_teacher(env, examples, TeacherConfig(**noisy))
    planned = run_teacher(env, examples, TeacherConfig(**noisy, plan=True))
    early = 0
    for ex, p, q in zip(examples, plain, planned):
        assert [i.query for i in p.infos] == [i.query for i in q.infos] and p.answer == q.answer
        lefts = [int(m.group(1)) for a in q.actions if (m := re.search(r"Steps left: (\d+)\.", a))]
        # every thought but a forced answer's (and a give-up's: every gold key failed, none here)
        assert len(lefts) == len(q.actions) - q.infos[-1].forced
        assert lefts[0] == len(ex.hops) and lefts == sorted(lefts, reverse=True)
        found = sum("Found:" in a for a in q.actions)
        assert lefts[-1] == len(ex.hops) - found
        if q.finish_reason == "answer" and not q.infos[-1].forced:
            assert "So the answer is" in q.actions[-1]
            early += lefts[-1] > 0
            if lefts[-1] == 0:
                assert exact_match(q.answer, ex.answers) == 1.0  # every hop found: the answer is right
    assert early >= 10  # answering too early, and saying so
