"""The per-episode agent loop (continuous batching) against the turn loop, and the HF stream against
`HFGenerator.generate`: for greedy decoding both give the same trajectories."""

import random

import pytest
import torch

from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import RolloutStats, branch, run, start_trajectories


class Steered(torch.nn.Module):
    """The agent model with a fixed bonus on a successor of each (input token, position mod 7): a random
    map in which tag tokens are frequent successors. Greedy actions then open and close searches and
    answers after different numbers of tokens in different episodes, as a trained agent's do (the 30-step
    agent model alone answers every question in its first action). The model's own logits, and so its KV
    cache, still enter every log-probability."""

    def __init__(self, model, tok, bonus=15.0, seed=0):
        super().__init__()
        self.lm, self.amount = model, bonus
        g = torch.Generator().manual_seed(seed)
        self.V = model.get_output_embeddings().weight.shape[0]
        succ = torch.randint(0, len(tok), (self.V * 7,), generator=g)
        tags = [tok.convert_tokens_to_ids(t) for t in ("<search>", "</search>", "<answer>", "</answer>")]
        u = torch.rand(len(succ), generator=g)
        for lo, hi, t in zip((0.0, 0.1, 0.2, 0.23), (0.1, 0.2, 0.23, 0.26), tags):
            succ[(u >= lo) & (u < hi)] = t
        self.register_buffer("succ", succ)

    def forward(self, input_ids, position_ids, **kw):
        out = self.lm(input_ids=input_ids, position_ids=position_ids, **kw)
        nxt = self.succ[input_ids * 7 + position_ids % 7]
        out.logits = out.logits + self.amount * torch.nn.functional.one_hot(nxt, self.V)
        return out


@pytest.fixture(scope="module")
def agent(agent_model_dir, world_bm25, small_world):
    """The steered agent; its random successor map depends on the tokenizer's size, which depends on the
    installed tokenizers release (the tiny tokenizer is trained at test time), so the first seed whose greedy
    episodes make valid searches is taken: every test below then runs on interleaving, searching episodes,
    whatever the versions (with tokenizers 0.22 the map of seed 0 made none)."""
    model, tok = load_model_and_tokenizer(agent_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    params = SamplingParams(0.0, 1.0, 24)
    for seed in range(20):
        steered = Steered(model, tok, seed=seed).eval()
        gen = HFGenerator(steered, tok, env.tags.stop_strings, batch_size=64)
        stats = run(
            start_trajectories(env, tok, small_world.examples("test")[:24]), env, gen, tok, params, 400
        )
        if stats.searches > 0:
            return steered, tok
    raise AssertionError("no steering seed in 0-19 made a valid search")


def assert_same(a, b):
    """Same trajectories: segments (kinds, ids, log-probs within 1e-4), steps, episode outcome."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert [s.kind for s in x.segments] == [s.kind for s in y.segments]
        for sx, sy in zip(x.segments, y.segments):
            assert sx.token_ids == sy.token_ids
            if sx.logprobs is not None:
                assert torch.allclose(torch.tensor(sx.logprobs), torch.tensor(sy.logprobs), atol=1e-4)
        assert [(s.segment, s.last_token, s.info) for s in x.steps] == [
            (s.segment, s.last_token, s.info) for s in y.steps
        ]
        assert x.finish_reason == y.finish_reason and x.group_id == y.group_id
        assert x.state.actions == y.state.actions and x.state.observations == y.state.observations
        assert x.state.answer == y.state.answer and x.state.done == y.state.done


def same_stats(a: RolloutStats, b: RolloutStats):
    keys = ("episodes", "tokens_generated", "actions", "invalid_actions", "searches", "finish_reasons")
    return {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


def both(trajs_of, env, model, tok, params, batch_size, max_total_tokens=400, max_steps=None):
    out = []
    for continuous in (False, True):
        gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=batch_size, continuous=continuous)
        trajs = trajs_of()
        stats = run(trajs, env, gen, tok, params, max_total_tokens, max_steps=max_steps)
        assert gen._saved == {}  # every episode's cache released
        out.append((trajs, stats))
    return out


@pytest.mark.parametrize("batch_size", [5, 64])
def test_greedy_fresh_episodes_match_the_turn_loop(agent, world_bm25, small_world, batch_size):
    """Fresh episodes, with a batch smaller than the episodes (new rows admitted mid-decode) and larger."""
    model, tok = agent
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    ex = small_world.examples("test")[:24]
    params = SamplingParams(0.0, 1.0, 24)
    (old, so), (new, sn) = both(lambda: start_trajectories(env, tok, ex), env, model, tok, params, batch_size)
    assert_same(old, new)
    assert same_stats(so, sn)
    first = {len(t.segments[1].token_ids) for t in new}  # actions end at different tokens: rows interleave
    assert len(first) > 3 and sn.searches > 0 and sn.actions > len(ex)


def test_greedy_branched_prefixes_match(agent, world_bm25, small_world):
    """SLATE / RAG-Gym candidates: k copies of a recorded prefix, one step each."""
    model, tok = agent
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    params = SamplingParams(0.0, 1.0, 24)
    prefixes = start_trajectories(env, tok, small_world.examples("test")[:8])
    run(prefixes, env, HFGenerator(model, tok, env.tags.stop_strings, continuous=False), tok, params, 400, 1)
    live = [p for p in prefixes if not p.state.done]
    assert live
    (old, so), (new, sn) = both(lambda: branch(live, 3), env, model, tok, params, 64, max_steps=1)
    assert_same(old, new)
    assert same_stats(so, sn)
    assert all(len(t.steps) == len(p.steps) + 1 for t, p in zip(new, [p for p in live for _ in range(3)]))


def test_greedy_research_design_matches(agent, world_bm25, small_world):
    """A re-rendered design (RAG-Gym ReSearch): each action starts from the rendered state."""
    model, tok = agent
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3, agent="research")
    params = SamplingParams(0.0, 1.0, 24)
    ex = small_world.examples("test")[:12]
    (old, so), (new, sn) = both(lambda: start_trajectories(env, tok, ex), env, model, tok, params, 4)
    assert_same(old, new)
    assert same_stats(so, sn)


def test_sampled_episodes_are_well_formed(agent, world_bm25, small_world):
    model, tok = agent
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    torch.manual_seed(0)
    trajs = start_trajectories(env, tok, small_world.examples("test")[:6], group_size=4)
    gen = HFGenerator(model, tok, env.tags.stop_strings, batch_size=7)
    stats = run(trajs, env, gen, tok, SamplingParams(1.0, 1.0, 24), max_total_tokens=300)
    for t in trajs:
        assert t.state.done and t.steps[-1].last_token < 300  # actions within the budget (the last
        # observation may pass it, in both loops: build_batch truncates)
        actions = [s for s in t.segments if s.kind == "action"]
        assert [tok.decode(s.token_ids) for s in actions] == t.state.actions
        assert all(len(s.logprobs) == len(s.token_ids) for s in actions)
    assert stats.episodes == 24 and stats.tokens_generated == sum(t.n_action_tokens for t in trajs)


def test_stream_gives_each_request_what_generate_gives_it_alone(agent):
    """Requests of random lengths added at random decode steps, more than the batch holds, some resuming
    a cached prefix: each gets exactly the greedy tokens (and log-probs) of `generate` on its prompt."""
    model, tok = agent
    rng = random.Random(0)
    words = ["Question:", "Who", "directed", "Keve", "?", "<search>", "film", "born", "in", "the", "city"]
    prompts = [tok(" ".join(rng.choices(words, k=rng.randint(2, 30))))["input_ids"] for _ in range(12)]
    params = SamplingParams(0.0, 1.0, 10)
    ref = HFGenerator(model, tok, ("</search>",), continuous=False)
    expected = {i: ref.generate([p], params)[0] for i, p in enumerate(prompts)}
    gen = HFGenerator(model, tok, ("</search>",), batch_size=4)
    got, budget = {}, {i: rng.randint(1, 10) for i in range(12)}
    with gen.stream(params) as s:
        pending = list(range(12))
        while pending or len(s):
            for _ in range(rng.randint(0, 2)):
                if pending:
                    i = pending.pop()
                    s.add(i, prompts[i], budget[i])
            got.update(s.step())
    for i, g in got.items():
        e = expected[i]
        n = len(g.token_ids)
        assert g.token_ids == e.token_ids[:n]
        assert n == len(e.token_ids) or (g.finish == "length" and n == budget[i])
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs[:n]), atol=1e-4)
    assert len(got) == 12 and s.rows == [] and not s.queue
