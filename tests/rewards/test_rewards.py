import pytest

from searchrl.core.config import RewardSpec
from searchrl.core.records import Example
from searchrl.core.types import Segment, Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.rewards import REWARDS, RewardOutput, register_reward
from searchrl.rewards.pipeline import RewardPipeline
from searchrl.rewards.research import research_format_ok, research_reward

EX = Example(id="q", question="Who?", answers=("Ann Lee",))


class Docs:
    def search(self, queries, k):
        from searchrl.core.records import Doc

        return [[Doc(id="d1", title="Ann", text="Ann Lee is here")] for _ in queries]


def episode(actions, tags="research"):
    env = SearchEnv(Docs(), tags=tags, template="short", max_turns=5)
    state = env.reset(EX)
    for a in actions:
        if not state.done:
            env.step(state, a)
    return Trajectory(EX, [Segment("prompt", [1])], state=state)


GOOD = [
    "<think> look </think><search> ann </search>",
    r"<think> ok </think><answer> The final answer is \boxed{Ann Lee} </answer>",
]


def test_research_reward_eq2():
    t = episode(GOOD)
    assert research_reward(t, answers=EX.answers).score == 1.0
    half = episode([r"<think> x </think><answer> \boxed{Ann Smith} </answer>"])
    assert research_reward(half, answers=EX.answers).score == pytest.approx(0.5)  # F1 above 0
    wrong = episode([r"<think> x </think><answer> \boxed{Bob} </answer>"])
    assert research_reward(wrong, answers=EX.answers).score == pytest.approx(0.1)  # format floor
    no_box = episode(["<think> x </think><answer> Bob </answer>"])
    assert research_reward(no_box, answers=EX.answers).score == 0.0


@pytest.mark.parametrize(
    "text, ok",
    [
        ("<think> a </think><search> q </search><result> r </result><answer> \\boxed{x} </answer>", True),
        ("<think> a </think><answer> \\boxed{x} </answer>", True),
        ("<think> a <think> b </think></think><answer> \\boxed{x} </answer>", False),  # unbalanced / nested
        ("<think> a </think><answer> x </answer>", False),  # no \boxed{}
        ("<search> q </search><answer> \\boxed{x} </answer>", False),  # search without its result
        ("<result> r </result><answer> \\boxed{x} </answer>", False),  # result without a search
        ("<answer> \\boxed{x} </answer><answer> \\boxed{y} </answer>", False),  # two answers
        ("<answer> \\boxed{x} </answer> trailing", False),
        ("<think> a </think>", False),  # no answer
        (
            "<search> q </search><information> r </information><answer> \\boxed{x} </answer>",
            False,
        ),  # wrong tag
    ],
)
def test_research_format(text, ok):
    assert research_format_ok(text) is ok


def test_em_f1_rewards_and_pipeline():
    t = episode(["<answer> ann lee </answer>"], tags="search_r1")
    t2 = episode(["<answer> Ann </answer>"], tags="search_r1")
    pipe = RewardPipeline([RewardSpec("em"), RewardSpec("f1", weight=0.5)])
    m = pipe([t, t2])
    assert t.reward == pytest.approx(1.0 + 0.5) and t2.reward == pytest.approx(
        0.0 + 0.5 * (2 * 1 * 0.5 / 1.5)
    )
    assert m["reward/em"] == pytest.approx(0.5)


def test_custom_process_reward_with_args():
    @register_reward("test_rewards_bonus", kind="process")
    def bonus(traj, *, answers, per_search=1.0, **_):
        scores = [per_search if i.kind == "search" else 0.0 for i in traj.state.infos]
        return RewardOutput(score=sum(scores), step_scores=tuple(scores))

    t = episode(GOOD)
    t.steps = [None, None]  # two steps recorded by the rollout loop
    RewardPipeline([RewardSpec("test_rewards_bonus", weight=2.0, args={"per_search": 0.25})])([t])
    assert t.reward == 0.5 and t.step_rewards == [0.5, 0.0]
    assert REWARDS.meta("test_rewards_bonus") == {"kind": "process"}
    with pytest.raises(ValueError, match="no rewards configured"):
        RewardPipeline([])


@pytest.mark.parametrize(
    "actions, expected",
    [
        (["<think> a </think><search> ann </search>", "<think> b </think><answer> Ann Lee </answer>"], 1.0),
        (["<answer> Ann Lee </answer> <search>"], 0.8),  # correct, broken structure: score - 0.2
        (["<think> a </think><search> ann </search>", "<think> b </think><answer> Bob </answer>"], 0.3),
        (["<think> b </think><answer> Bob </answer>"], 0.2),  # valid, gold never retrieved
        (["<answer> Bob </answer> </think>"], 0.1),  # wrong and broken: final-format score
    ],
)
def test_search_r1_format_reward_cases(actions, expected):
    from searchrl.rewards.outcome import search_r1_format_reward

    t = episode(actions, tags="search_r1")
    # the v0.2 retrieval bonus (0.1): the 0.3 row; the default is v0.3's 0
    assert search_r1_format_reward(t, answers=EX.answers, retrieval_score=0.1).score == pytest.approx(
        expected
    )
    assert search_r1_format_reward(t, answers=EX.answers).score == pytest.approx(
        0.2 if expected == 0.3 else expected
    )


def test_search_r1_format_reward_without_an_answer():
    from searchrl.rewards.outcome import search_r1_format_reward

    t = episode(["<think> a </think><search> ann </search>"], tags="search_r1")
    assert t.answer is None
    assert search_r1_format_reward(t, answers=EX.answers).score == 0.0  # unfinished: no final <answer>


def test_rewards_get_only_the_fields_they_name_and_lazy_resources():
    built = []

    def needs_docs(traj, *, docs, scale=1.0):
        return scale * len(docs)

    def plain(traj, *, answers):
        return float(len(answers))

    t = episode(GOOD)
    resources = {"docs": lambda: built.append(1) or {"a": 1, "b": 2}}
    from searchrl.rewards.pipeline import call_reward

    assert call_reward(plain, t, {}, resources).score == 1.0 and built == []  # never built: not asked for
    pipe = RewardPipeline([RewardSpec("em")], resources)
    assert call_reward(needs_docs, t, {"scale": 0.5}, pipe.resources).score == 1.0
    assert call_reward(needs_docs, t, {}, pipe.resources).score == 2.0 and built == [1]  # built once


def test_cover_em_rewards_a_gold_answer_inside_the_answer():
    """R1-Searcher's cover EM: "directed by Ann Lee." covers "Ann Lee" (EM 0); "Ann" covers nothing."""
    t = episode(["<answer> It was directed by Ann Lee. </answer>"], tags="search_r1")
    t2 = episode(["<answer> Ann </answer>"], tags="search_r1")
    RewardPipeline([RewardSpec("cover_em")])([t, t2])
    assert t.reward == 1.0 and t2.reward == 0.0
    RewardPipeline([RewardSpec("em")])([t])
    assert t.reward == 0.0
