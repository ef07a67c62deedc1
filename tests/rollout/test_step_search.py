"""`step_search`: one scorer call per step over every live episode's candidates, the chosen candidate
continues, an episode without room ends, ``max_steps`` bounds the steps."""

from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.loop import start_trajectories
from searchrl.rollout.step_search import best, step_search
from tests.helpers import ScriptedCandidates


def test_step_search_scores_once_per_step_and_continues_with_the_choice(
    tiny_model_dir, world_bm25, small_world
):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    exs = [e for e in small_world.examples("train") if e.n_hops == 1][:2]
    searches = [f"<think> a </think>\n<search> {e.hops[0].keys[0]} </search>" for e in exs]
    junk = "<think> b </think>\n<search> zzq qqz </search>"
    answers = [f"<think> c </think>\n<answer> {e.answers[0]} </answer>" for e in exs]
    # step 1: row j of the 3 candidates per episode; the scorer prefers the gold search of each episode
    gen = ScriptedCandidates(
        tok,
        [
            [junk, searches[0], junk, junk, searches[1], junk],
            [answers[0], junk, junk, answers[1], junk, junk],
        ],
    )
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=3)
    calls, chosen = [], []

    def score(pairs):
        calls.append(len(pairs))
        return [1.0 if "zzq" not in c.episode.actions[-1] else 0.0 for _, c in pairs]

    def choose(q, t, prefix, group, scores):
        chosen.append((q, t, scores))
        return best(q, t, prefix, group, scores)

    out = step_search(
        start_trajectories(env, tok, exs), 3, score, choose, env, gen, tok, SamplingParams(1.0, 1.0, 32), 512
    )
    assert calls == [6, 6]  # one call per step, every live episode's candidates at once
    assert [(q, t) for q, t, _ in chosen] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    for e, traj, s, a in zip(exs, out, searches, answers):
        assert traj.episode.actions == [s, a] and traj.episode.done and traj.answer == e.answers[0]
    one = step_search(
        start_trajectories(env, tok, exs),
        3,
        score,
        best,
        env,
        ScriptedCandidates(tok, [[junk, searches[0], junk]]),
        tok,
        SamplingParams(1.0, 1.0, 32),
        512,
        max_steps=1,
    )
    assert [len(t.episode.actions) for t in one] == [1, 1] and not any(t.episode.done for t in one)
    # no room left to generate (a token budget below the prompt): the group is empty and the episode ends
    ended = step_search(
        start_trajectories(env, tok, exs[:1]), 2, score, best, env, gen, tok, SamplingParams(1.0, 1.0, 32), 8
    )
    assert ended[0].episode.done and ended[0].episode.actions == []
