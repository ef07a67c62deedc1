"""`public_code_compat` reproduces the papers' public reward code; the paper modes follow the equations.

Random episodes (well-formed and malformed: missing or unclosed tags, glued and trailing text, two answers,
repeated searches, missing boxes, truncated episodes) are run through the real environment, then scored by
our rewards and by independent restatements of the public code (`public_reference.py`) on the decoded text:
the score and every step reward must agree within 1e-4. Hand-computed cases pin each difference the
reward-fidelity review listed.
"""

from __future__ import annotations

import random

import pytest

from searchrl.core.types import Segment, Step, Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.rewards.outcome import search_r1_format_reward
from searchrl.rewards.research import cut_at_stop, research_reward
from searchrl.rewards.stepsearch import search_keys_public, split_documents, stepsearch_reward
from tests.rewards import public_reference as ref

WORDS = ["alpha", "beta", "where", "born", "the", "who", "city", "of", "film", "director"]


def random_action(rng: random.Random, hop, boxed: bool) -> str:
    """A search agent's action, often malformed."""
    think = rng.choice(
        [
            "<think> " + " ".join(rng.sample(WORDS, 3)) + " </think>\n",
            "",
            "<think> x ",
            "<think> y </think> </think>",
        ]
    )
    query = rng.choice(
        [
            hop.keys[0] if hop.keys else "x",
            hop.gold_title or "x",
            " ".join(rng.sample(WORDS, 2)),
            "",
            hop.answer,
        ]
    )
    ans = rng.choice([hop.answer, "nobody", "yes", "the " + hop.answer])
    body = f"The final answer is \\boxed{{{ans}}}" if boxed else ans
    if boxed and rng.random() < 0.2:
        body = rng.choice([ans, f"\\boxed{{{ans}}} or \\boxed{{nobody}}", "\\boxed{"])
    kind = rng.random()
    if kind < 0.45:
        action = f"{think}<search> {query} </search>"
    elif kind < 0.75:
        action = f"{think}<answer> {body} </answer>"
    elif kind < 0.85:
        action = f"{think}<answer> {body} </answer> <answer> {ans} </answer>"
    else:
        action = rng.choice(
            [think + "just text", f"{think}<search> {query}", "<search></search>", "</answer>"]
        )
    return action + rng.choice(["", "", ".", "\n\n", ">."])  # what a last token may carry


def random_episode(env: SearchEnv, example, rng: random.Random) -> Trajectory:
    st = env.reset(example)
    traj = Trajectory(example, [Segment("prompt", [0])], state=st)
    for _ in range(env.max_turns + 1):
        if st.done:
            break
        hop = rng.choice(example.hops)
        action = random_action(rng, hop, env.tags.boxed)
        stopped = any(t in action for t in env.tags.stop_strings)
        _, _, info = env.step(st, action, stopped=stopped)
        traj.segments.append(Segment("action", [1]))
        traj.steps.append(Step(segment=len(traj.segments) - 1, last_token=len(traj.steps), info=info))
    traj.finish_reason = st.finish_reason if st.done else "length"
    return traj


def chat(messages) -> str:
    return (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        + "<|im_start|>assistant\n"
    )


def transcript(traj) -> str:
    st = traj.state
    return st.prompt + "".join(cut_at_stop(a) + o for a, o in zip(st.actions, st.observations))


def step_of_position(traj, pos: int) -> int:
    """Which step's action holds the character before ``pos`` of `transcript`."""
    st = traj.state
    start, last = len(st.prompt), None
    for k, (a, o) in enumerate(zip(st.actions, st.observations)):
        if start < pos:
            last = k
        end = start + len(cut_at_stop(a))
        if start < pos <= end:
            return k
        start = end + len(o)
    return last


@pytest.fixture(scope="module")
def docs(small_world):
    return {d.id: d for d in small_world.documents()}


@pytest.mark.parametrize("template", ["search_r1", "search_r1_instruct"])
def test_stepsearch_matches_the_public_code_on_random_episodes(small_world, world_bm25, docs, template):
    env = SearchEnv(world_bm25, template=template, topk=2, max_turns=4, doc_format="stepsearch", chat=chat)
    rng = random.Random(0)
    seen_scores = set()
    for n, ex in enumerate(small_world.examples("train")[:110]):
        t = random_episode(env, ex, rng)
        ours = stepsearch_reward(
            t, answers=ex.answers, hops=ex.hops, example=ex, docs=docs, public_code_compat=True
        )
        text = transcript(t)
        marker = "<|im_start|>assistant"
        solution = text.split(marker)[-1].strip() if marker in text else text
        gold = [docs[h.gold_doc_id].text for h in ex.hops if h.gold_doc_id in docs]
        score, steps = ref.stepsearch_public(solution, ex.answers, [h.keys for h in ex.hops], gold)
        response = text[len(t.episode.prompt) :]
        expected = [0.0] * len(t.steps)
        for value, end in zip(steps, ref.stepsearch_step_positions(response)):
            expected[step_of_position(t, len(t.episode.prompt) + end)] += 1.6 * value
        assert ours.score == pytest.approx(score, abs=1e-4), (n, solution)
        assert ours.step_scores == pytest.approx(tuple(expected), abs=1e-4), (n, solution)
        seen_scores.add(-1.0 if score == -1.0 else "scored")
    assert seen_scores == {-1.0, "scored"}  # both malformed and scored episodes were covered


def test_research_matches_the_public_code_on_random_episodes(small_world, world_bm25):
    env = SearchEnv(world_bm25, tags="research", template="research", topk=2, max_turns=3)
    rng = random.Random(1)
    outcomes = set()
    for ex in small_world.examples("train")[:200]:
        t = random_episode(env, ex, rng)
        eos = "<|endoftext|>" if t.finish_reason in ("answer", "eos") else ""
        expected = ref.research_public(transcript(t) + eos, ex.answers)
        assert research_reward(t, answers=ex.answers, public_code_compat=True).score == pytest.approx(
            expected, abs=1e-4
        )
        outcomes.add(expected if expected in (0.0, 0.1) else "f1")
    assert outcomes == {0.0, 0.1, "f1"}


@pytest.mark.parametrize("template", ["search_r1_instruct", "search_r1"])
def test_search_r1_format_matches_the_public_code_on_random_episodes(small_world, world_bm25, template):
    env = SearchEnv(world_bm25, template=template, topk=2, max_turns=3, chat=chat)
    rng = random.Random(2)
    outcomes = set()
    for ex in small_world.examples("train")[:200]:
        t = random_episode(env, ex, rng)
        expected = ref.search_r1_public(transcript(t), ex.answers)
        got = search_r1_format_reward(t, answers=ex.answers, public_code_compat=True).score
        assert got == pytest.approx(expected, abs=1e-4)
        outcomes.add(round(expected, 2))
    if template == "search_r1_instruct":  # malformed/valid x wrong/right all occurred
        assert {0.1, 0.2, 0.8, 1.0} <= outcomes
    else:  # no chat template: the public check never finds the assistant turn, so nothing is well formed
        assert outcomes == {0.1, 0.8}


# ------------------------------------------------------------------------------ hand-computed public cases
def test_public_search_key_assignment_overwrites_and_averages():
    # queries [alpha, beta] vs groups {alpha}, {beta}: each query takes its own group -> (1 + 1) / 2
    assert search_keys_public(["alpha", "beta"], [["alpha"], ["beta"]]) == 1.0
    # "alpha" sets group 0 to 1; "alpha beta" ties both groups at 0.6667 and takes the first, overwriting 1
    assert search_keys_public(["alpha", "alpha beta"], [["alpha"], ["beta"]]) == pytest.approx(0.6667 / 2)


def test_public_search_key_counts_a_hop_without_keys(small_world, world_bm25, docs):
    """A hop with no keys: the public code still divides by its (never matched) group, so a query matching
    the other hop's key scores 1/2, where the paper's eq. (5) averages over the keyed hops only (1.0)."""
    from dataclasses import replace

    ex = next(e for e in small_world.examples("train") if e.n_hops == 2)
    ex = replace(ex, hops=(replace(ex.hops[0], keys=("alpha beta",)), replace(ex.hops[1], keys=())))
    env = SearchEnv(world_bm25, template="search_r1", topk=2, max_turns=3, doc_format="stepsearch")
    st = env.reset(ex)
    t = Trajectory(ex, [Segment("prompt", [0])], state=st)
    for action in ["<think> x </think><search> alpha beta </search>", "<answer> nobody </answer>"]:
        _, _, info = env.step(st, action, stopped=True)
        t.segments.append(Segment("action", [1]))
        t.steps.append(Step(segment=len(t.segments) - 1, last_token=len(t.steps), info=info))
    t.finish_reason = st.finish_reason
    public = stepsearch_reward(
        t, answers=ex.answers, hops=ex.hops, example=ex, docs=docs, public_code_compat=True
    )
    paper = stepsearch_reward(t, answers=ex.answers, hops=ex.hops, example=ex, docs=docs)
    assert public.metrics["key"] == pytest.approx(0.5)
    assert paper.metrics["key"] == pytest.approx(1.0)  # paper mode unchanged
    solution = transcript(t)
    gold = [docs[h.gold_doc_id].text for h in ex.hops if h.gold_doc_id in docs]
    score, _ = ref.stepsearch_public(solution, ex.answers, [h.keys for h in ex.hops], gold)
    assert public.score == pytest.approx(score, abs=1e-4)


def test_research_public_scores_after_a_marker_the_response_writes(small_world, world_bm25):
    """Base template: the public code scores ``(prompt + response).split("<|im_start|>assistant\\n")[1]``, the
    text after a marker the response itself writes (1.0 here), not the text before it."""
    ex = small_world.examples("train")[0]
    env = SearchEnv(world_bm25, tags="research", template="research", topk=2, max_turns=3)
    st = env.reset(ex)
    t = Trajectory(ex, [Segment("prompt", [0])], state=st)
    action = (
        "stray text<|im_start|>assistant\n<think> so </think>"
        f"<answer> The final answer is \\boxed{{{ex.answers[0]}}} </answer>"
    )
    _, _, info = env.step(st, action, stopped=True)
    t.segments.append(Segment("action", [1]))
    t.steps.append(Step(segment=1, last_token=0, info=info))
    t.finish_reason = st.finish_reason
    expected = ref.research_public(transcript(t) + "<|endoftext|>", ex.answers)
    assert expected == 1.0
    assert research_reward(t, answers=ex.answers, public_code_compat=True).score == expected


def test_public_documents_carry_the_next_label():
    block = "Doc 1<## Title: A ##> text a\nDoc 2<## Title: B ##> text b"
    assert split_documents(block) == ["text a\nDoc 2", "text b"]  # the same text at rank 2 reads differently


def test_paper_f1_has_no_yes_no_rule():
    from searchrl.core.answers import f1_score, plain_f1

    assert plain_f1("yes queen", ["yes"]) == pytest.approx(2 / 3)  # StepSearch eq. 2
    assert f1_score("yes queen", ["yes"]) == 0.0  # HotpotQA's rule (evaluation, ReSearch)
