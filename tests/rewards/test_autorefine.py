"""AutoRefine (arXiv 2505.11277): the teacher's refine blocks, their masks, and the reward against
hand-computed values and a reference written from AutoRefine's released ``compute_score_f1``."""

from __future__ import annotations

import re
import string
from collections import Counter
from types import SimpleNamespace

import pytest

from searchrl.app.eval_episodes import episode_metrics
from searchrl.core.config import TeacherConfig
from searchrl.envs.search import SearchEnv
from searchrl.envs.synthetic.teacher import run_teacher
from searchrl.rewards.autorefine import autorefine_reward, refined_text, well_formed


def episode(actions, answer):
    return SimpleNamespace(state=SimpleNamespace(actions=actions), answer=answer)


SEARCH = "<think> who directed Keve </think>\n<search> Keve director </search>"
REFINED = "<refine> Keve was directed by Ann Lee. </refine>\n<think> so </think>\n<answer> Bob </answer>"
UNREFINED = "<think> so </think>\n<answer> Bob </answer>"


def test_reward_hand_computed():
    gold = ["Ann Lee"]
    right = episode([SEARCH, REFINED.replace("Bob", "Ann Lee")], "Ann Lee")
    assert autorefine_reward(right, answers=gold).score == 1.0  # R_ans > 0: the answer's F1
    partial = episode([SEARCH, REFINED.replace("Bob", "Lee")], "Lee")
    assert autorefine_reward(partial, answers=gold).score == pytest.approx(2 * 1 * 0.5 / 1.5)
    wrong = autorefine_reward(episode([SEARCH, REFINED], "Bob"), answers=gold)
    assert wrong.score == pytest.approx(0.1) and wrong.metrics == {"refine_hit": 1.0, "refine_blocks": 1.0}
    assert autorefine_reward(episode([SEARCH, UNREFINED], "Bob"), answers=gold).score == 0.0
    assert autorefine_reward(episode([SEARCH, REFINED], "Bob"), answers=gold, format_score=0.2).score == (
        pytest.approx(0.3)
    )
    assert autorefine_reward(episode([SEARCH, REFINED], None), answers=gold).score == 0.0  # no answer: 0
    assert autorefine_reward(episode([SEARCH, REFINED], "Lee"), answers=gold, answer_metric="em").score == 0.1
    with pytest.raises(ValueError, match="answer_metric"):
        autorefine_reward(right, answers=gold, answer_metric="bleu")


# ----------------------------------------------------------------- AutoRefine's released scoring, re-read


def _norm(s):
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _f1(pred, golds):
    best = 0.0
    for g in golds:
        p, t = _norm(pred), _norm(g)
        if (p in ("yes", "no", "noanswer") or t in ("yes", "no", "noanswer")) and p != t:
            continue
        common = Counter(p.split()) & Counter(t.split())
        n = sum(common.values())
        if n:
            pr, rc = n / len(p.split()), n / len(t.split())
            best = max(best, 2 * pr * rc / (pr + rc))
    return best


def reference_score(response, golds, refine_score=0.1, format_score=0.0):
    """``compute_score_f1`` of AutoRefine's ``qa_em.py`` on the assistant's text: the last <answer> (None: 0),
    its F1 if positive, else format_score·validate_format + refine_score·[gold ⊂ joined refine blocks]."""
    matches = re.findall(r"<answer>(.*?)</answer>", response, re.S)
    if not matches:
        return 0.0
    f1 = _f1(matches[-1].strip(), golds)
    if f1 > 0:
        return f1
    valid = all(
        response.count(f"<{t}>") == response.count(f"</{t}>") and response.count(f"<{t}>") > 0
        for t in ("think", "search", "refine", "answer")
    )
    refine = " ".join(re.findall(r"<refine>(.*?)</refine>", response, re.S)).strip()
    hit = bool(refine) and any(_norm(g) in _norm(refine) for g in golds)
    return format_score * valid + refine_score * hit


@pytest.mark.parametrize(
    "second,answer",
    [
        (REFINED, "Bob"),
        (REFINED.replace("Bob", "Lee"), "Lee"),
        (UNREFINED, "Bob"),
        (REFINED.replace("Ann Lee", "someone"), "Bob"),
        (REFINED.replace("</refine>", ""), "Bob"),
    ],
)
def test_reward_equals_the_released_scoring(second, answer):
    ep = episode([SEARCH, second], answer)
    for fs in (0.0, 0.3):
        ours = autorefine_reward(ep, answers=["Ann Lee", "A. Lee"], format_score=fs).score
        assert ours == pytest.approx(reference_score(SEARCH + second, ["Ann Lee", "A. Lee"], format_score=fs))


def test_refined_text_and_format():
    assert refined_text(["<refine> a </refine> x", "<refine>b</refine>"]) == "a  b"
    assert refined_text(["no blocks"]) is None
    assert well_formed([SEARCH, REFINED]) and not well_formed([SEARCH, UNREFINED])


def test_teacher_refines_after_each_search_and_the_blocks_are_actions(world_bm25, small_world):
    """With ``refine``, every action after a search's documents opens with a refine block that restates
    what they established; the blocks are the agent's text (actions, trained), the documents observations;
    the teacher still solves the world and every refined text names each hop's answer it found."""
    env = SearchEnv(world_bm25, template="autorefine", topk=3, max_turns=6)
    examples = small_world.examples("test")[:40]
    states = run_teacher(env, examples, TeacherConfig(refine=True))
    assert episode_metrics(states)["em"] >= 0.95
    for s in states:
        assert all(i.valid for i in s.infos)
        for i, action in enumerate(s.actions):
            assert action.startswith("<refine>") == (i > 0)  # after every search's documents
        assert all("<refine>" not in o for o in s.observations)
        text = refined_text(s.actions)
        assert text is not None and s.example.hops[-1].answer in text
        ep = SimpleNamespace(state=s, answer=s.answer)
        assert autorefine_reward(ep, answers=list(s.example.answers)).metrics["refine_hit"] == 1.0
