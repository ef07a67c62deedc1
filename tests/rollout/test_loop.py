import torch

from searchrl.core.types import Segment
from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rollout.generator import Generation, SamplingParams
from searchrl.rollout.hf import HFGenerator
from searchrl.rollout.loop import branch, encode, rollout, run, start_trajectories


class ScriptedGenerator:
    """Returns fixed action texts (as the tokenizer would produce them) per call, to drive the loop."""

    def __init__(self, tok, actions):
        self.tok, self.actions, self.calls = tok, actions, 0

    def release(self, cache_keys=None):
        pass

    def generate(self, prompts, params, cache_keys=None):
        out = []
        for _ in prompts:
            text = self.actions[min(self.calls, len(self.actions) - 1)]
            ids = encode(self.tok, text)
            out.append(Generation(ids, [-0.1] * len(ids), "stop"))
        self.calls += 1
        return out


def test_loop_segments_steps_and_no_retokenization(tiny_model_dir, world_bm25, small_world):
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    ex = small_world.examples("test")[:3]
    torch.manual_seed(0)
    trajs, stats = rollout(
        ex,
        env,
        HFGenerator(model, tok, env.tags.stop_strings),
        tok,
        SamplingParams(1.0, 1.0, 24),
        group_size=2,
        max_total_tokens=400,
    )
    assert len(trajs) == 6 and [t.group_id for t in trajs] == [0, 0, 1, 1, 2, 2]
    for t in trajs:
        assert t.state.done and t.finish_reason in ("answer", "eos", "length", "budget")
        kinds = [s.kind for s in t.segments]
        assert kinds[0] == "prompt" and all(k != "prompt" for k in kinds[1:])
        actions = [s for s in t.segments if s.kind == "action"]
        assert len(actions) == len(t.state.actions) == len(t.steps)
        for seg, text in zip(actions, t.state.actions):
            assert tok.decode(seg.token_ids) == text  # the env parsed exactly the sampled ids
            assert len(seg.logprobs) == len(seg.token_ids)
        obs = [s for s in t.segments if s.kind == "observation"]
        assert [tok.decode(s.token_ids) for s in obs] == [o for o in t.state.observations if o]
        for st in t.steps:
            assert t.token_ids[st.last_token] == t.segments[st.segment].token_ids[-1]
        assert len(t) <= 400
    assert stats.episodes == 6 and stats.tokens_generated == sum(t.n_action_tokens for t in trajs)


def test_scripted_episode_and_prefix_branching(tiny_model_dir, world_bm25, small_world):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=4)
    ex = small_world.examples("test")[0]
    key = ex.hops[0].keys[0]
    gen = ScriptedGenerator(tok, [f"<think> go </think>\n<search> {key} </search>", "<answer> x </answer>"])
    [t] = start_trajectories(env, tok, [ex])
    run([t], env, gen, tok, SamplingParams(), 2048, max_steps=1)
    assert not t.state.done and len(t.steps) == 1 and t.state.infos[0].query == key
    kids = branch([t], k=3)
    assert all(k.token_ids == t.token_ids for k in kids) and {k.group_id for k in kids} == {0}
    run(kids, env, gen, tok, SamplingParams(), 2048, max_steps=1)
    for k in kids:
        assert k.state.done and k.state.answer == "x" and len(k.steps) == 2
        assert k.token_ids[: len(t)] == t.token_ids  # the shared prefix is untouched
    assert len(t.steps) == 1 and not t.state.done  # branching copied, did not alias


def test_garbage_overlong_and_empty_outputs_never_crash(tiny_model_dir, world_bm25, small_world):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    ex = small_world.examples("test")[:4]
    for actions in (
        ["</search> <answer>"],
        ["<search>" + " word" * 300 + " </search>"],
        [""],
        ["<search></search>"],
    ):
        trajs = start_trajectories(env, tok, ex)
        run(trajs, env, ScriptedGenerator(tok, actions), tok, SamplingParams(), max_total_tokens=300)
        assert all(t.state.done for t in trajs)
        assert all(t.finish_reason in ("answer", "eos", "length", "budget") for t in trajs)


def test_an_episode_near_its_cap_does_not_cut_the_others_actions(tiny_model_dir, world_bm25, small_world):
    """One batch shares one token budget: the episodes with room for a whole action generate under
    max_new_tokens, those near the cap in a second batch under their own room."""
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=3)
    ex = small_world.examples("train")[:2]
    budgets = []

    class Recording:
        def release(self, cache_keys=None):
            pass

        def generate(self, prompts, params, cache_keys=None):
            budgets.append((len(prompts), params.max_new_tokens))
            ids = encode(tok, "<answer> x </answer>")[: params.max_new_tokens]
            return [Generation(ids, [-0.1] * len(ids), "stop") for _ in prompts]

    trajs = start_trajectories(env, tok, ex)
    pad = encode(tok, " x")[0]
    trajs[0].segments.append(
        Segment("observation", [pad] * (96 - len(trajs[0])))
    )  # 4 tokens of room under 100
    run(trajs, env, Recording(), tok, SamplingParams(max_new_tokens=16), max_total_tokens=100)
    assert sorted(budgets) == [(1, 4), (1, 16)]
    assert trajs[1].answer == "x" and trajs[1].finish_reason == "answer"
