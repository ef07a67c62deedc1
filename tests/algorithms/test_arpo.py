"""ARPO (arXiv 2507.19849): the sampler's entropy as the generators record it, the branching rule against the
released code's, branch points, the hard attribution against hand-computed values, and a collected and trained
step on the quickstart world (M rows per question, branches that extend their chain's tokens as sampled)."""

from __future__ import annotations

import random

import pytest
import torch

from searchrl.algorithms.arpo import ARPOConfig, branch_points, branch_taken, shared_prefix_mean
from searchrl.core.config import TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.core.types import RolloutBatch
from searchrl.rollout.generator import SamplingParams
from tests.algorithms.test_turn_credit import episode
from tests.engine.test_trainer import trainer_for


def forward_entropy(model, prompt, generated, k, temperature):
    """H(softmax(logits / T)) at the positions that sampled the first k generated tokens, from one forward."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + k].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return (-(logp.exp() * logp).sum(-1)).tolist()


@pytest.mark.parametrize("continuous", [False, True])
def test_generators_record_the_sampling_entropy(tiny_model_dir, continuous):
    """Both HF paths (one batch per turn, the continuous stream) record H(π_T) at the first k tokens of each
    generation, equal to a forward pass over the sampled ids; none when not asked."""
    from searchrl.models import load_model_and_tokenizer
    from searchrl.rollout.hf import HFGenerator

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    model.eval()
    prompts = [tok("Question: Who directed Keve?\n")["input_ids"], tok("Q\n")["input_ids"]]
    gen = HFGenerator(model, tok, stop_strings=(), continuous=continuous)
    torch.manual_seed(0)
    outs = (
        gen._generate_streamed(prompts, SamplingParams(0.7, 1.0, 8, entropy_tokens=3), None)
        if continuous
        else (gen.generate(prompts, SamplingParams(0.7, 1.0, 8, entropy_tokens=3)))
    )
    for p, o in zip(prompts, outs):
        k = min(3, len(o.token_ids))
        assert o.entropy is not None and len(o.entropy) == k
        assert o.entropy == pytest.approx(forward_entropy(model, p, o.token_ids, k, 0.7), abs=1e-4)
    plain = gen.generate(prompts, SamplingParams(0.7, 1.0, 4))
    assert all(o.entropy is None for o in plain)


def test_entropy_on_qwen_vocabulary(qwen_model_dir):
    """At Qwen2.5's 151,665-token vocabulary the recorded entropy equals the forward's too (greedy: T = 1)."""
    from searchrl.models import load_model_and_tokenizer
    from searchrl.rollout.hf import HFGenerator

    model, tok = load_model_and_tokenizer(qwen_model_dir)
    model.eval()
    prompt = tok("<search>Keve director</search>")["input_ids"]
    (o,) = HFGenerator(model, tok, continuous=False).generate(
        [prompt], SamplingParams(0.0, 1.0, 4, entropy_tokens=4)
    )
    assert o.entropy == pytest.approx(
        forward_entropy(model, prompt, o.token_ids, len(o.token_ids), 1.0), abs=1e-3
    )
    assert all(0 < h <= torch.log(torch.tensor(151665.0)).item() + 1e-3 for h in o.entropy)


def released_rule(u, delta, tau, weight):
    """The released code's lines (``vllm_rollout_with_tools.py``): prob = random() − w·ΔH, clipped to [0, 1];
    ``if prob > branch_probability: continue`` (no branch)."""
    prob = u - weight * delta
    prob = max(0.0, min(1.0, prob))
    return not prob > tau


def test_branch_rule_hand_computed_and_as_released():
    assert branch_taken(0.6, 0.5, 0.5, 0.2)  # 0.6 − 0.1 = 0.5 ≤ 0.5
    assert not branch_taken(0.61, 0.5, 0.5, 0.2)  # 0.51 > 0.5
    assert not branch_taken(0.3, -2.0, 0.5, 0.2)  # entropy fell: 0.3 + 0.4 = 0.7 > 0.5
    assert branch_taken(0.9, 3.0, 0.0, 0.5)  # 0.9 − 1.5 clipped to 0 ≤ 0
    rng = random.Random(0)
    for _ in range(2000):
        u, d, tau, w = rng.random(), rng.uniform(-3, 3), rng.random(), rng.uniform(0, 1)
        assert branch_taken(u, d, tau, w) == released_rule(u, d, tau, w)
    # over u ~ U(0, 1) the branch probability is clip(τ + β·ΔH, 0, 1)
    draws = [branch_taken(rng.random(), 1.0, 0.5, 0.2) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(0.7, abs=0.02)


def test_branch_points_follow_observations():
    t = episode([1, 2], [([10], [50]), ([11], [51]), ([12], None)], 1.0, 0)
    assert branch_points(t, 0) == [0, 1] and branch_points(t, 1) == [1] and branch_points(t, 2) == []
    cut = episode([1], [([10], [50]), ([11], None)], 0.0, 0)  # an answer: no observation after step 1
    assert branch_points(cut, 0) == [0]


def batch_of(rows, group_ids, loss_masks):
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    am = torch.zeros(len(rows), T, dtype=torch.long)
    lm = torch.zeros(len(rows), T)
    for i, (r, m) in enumerate(zip(rows, loss_masks)):
        ids[i, : len(r)], am[i, : len(r)], lm[i, : len(m)] = (
            torch.tensor(r),
            1,
            torch.tensor(m, dtype=torch.float),
        )
    z = torch.zeros(len(rows), T)
    return RolloutBatch(
        ids,
        am,
        lm,
        z.bool(),
        z.long() - 1,
        torch.zeros(len(rows), 1).long(),
        torch.zeros(len(rows), 1).bool(),
        z,
        torch.zeros(len(rows)),
        torch.zeros(len(rows), 1),
        torch.tensor(group_ids),
        torch.full((len(rows),), -1),
        torch.zeros(len(rows)).bool(),
    )


def test_hard_attribution_hand_computed():
    """Rows 0 and 1 share the prompt [1, 2], the action [3, 4] and the observation [9]; they then differ (5 against
    6); row 2 leaves after the prompt; row 3 is another question. Advantages [1, −1, 0.5 | 2]: the shared action
    tokens get (1 − 1) / 2 = 0, the rest their own row's; the other question is untouched."""
    rows = [[1, 2, 3, 4, 9, 5, 7], [1, 2, 3, 4, 9, 6], [1, 2, 8, 8], [1, 2, 3]]
    masks = [[0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 1], [0, 0, 1, 1], [0, 0, 1]]
    b = batch_of(rows, [0, 0, 0, 1], masks)
    out = shared_prefix_mean(torch.tensor([1.0, -1.0, 0.5, 2.0]), b)
    assert out[0].tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert out[1].tolist() == [0, 0, 0, 0, 0, -1, 0]
    assert out[2].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0]
    assert out[3].tolist() == [0, 0, 2, 0, 0, 0, 0]
    b.group_ids[:] = torch.tensor([0, 0, -1, 1])  # a padding row (negative group) shares nothing
    assert shared_prefix_mean(torch.tensor([1.0, -1.0, 0.5, 2.0]), b)[2].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0]


def test_config_is_checked(make_exp):
    from searchrl.app.experiment import check_arguments

    with pytest.raises(ValueError, match="initial_rollouts"):
        ARPOConfig(group_size=4, initial_rollouts=5)
    with pytest.raises(ValueError, match="branch_probability"):
        ARPOConfig(branch_probability=1.5)
    with pytest.raises(ValueError, match="hard attribution"):
        ARPOConfig(attribution="hard", advantage="rloo")
    check_arguments(make_exp("algorithm={name: arpo, group_size: 4, initial_rollouts: 2}"))
    with pytest.raises(ConfigError, match="rollout.compile"):
        check_arguments(make_exp("algorithm={name: arpo}", "rollout.compile=true"))
    with pytest.raises(ConfigError, match="env.tools"):
        check_arguments(
            make_exp(
                "algorithm={name: arpo}",
                "env.protocol=tools",
                "env.template=tools",
                'env.tools=[{name: search}, {name: mcp, args: {server: "http://127.0.0.1:9/mcp"}}]',
            )
        )


@pytest.mark.parametrize("attribution", ["soft", "hard"])
def test_arpo_collects_m_rows_per_question_and_trains(make_exp, agent_model_dir, tmp_path, attribution):
    """Two questions × M 4 rows from N 2 chains of the tiny agent, τ = 1: whatever branched (the agent searches
    in some episodes) begins with its chain's tokens up to an observation, as sampled, and carries the
    entropies of the steps it shares; M rows per question; a step trains."""
    from searchrl.rollout.episode import STEP_ENTROPY

    exp = make_exp(
        f"model.path={agent_model_dir}",
        "env.template=short",
        "env.topk=2",
        "env.max_turns=3",
        "rollout.temperature=1.0",
        "rewards=[{name: test_trainer_length}]",
    )
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=5e-3, save_every=10**6)
    args = {"kl_coef": 0.0, "group_size": 4, "initial_rollouts": 2, "branch_probability": 1.0}
    args.update({"entropy_tokens": 3, "attribution": attribution})
    tr = trainer_for(exp, "arpo", cfg, args=args, out=tmp_path / "run")
    rows, metrics = tr.algo.collect([0, 1])
    assert len(rows) == 8 and sorted({t.group_id for t in rows}) == [0, 1]
    assert all(sum(t.group_id == g for t in rows) == 4 for g in (0, 1))
    assert metrics["arpo/branches"] + metrics["arpo/fresh_rows"] == 4
    for t in rows:
        if STEP_ENTROPY in t.info:  # chains and branches (fresh rows fill the budget without it)
            assert len(t.info[STEP_ENTROPY]) == len(t.steps)
        if "arpo_branch_step" in t.info:
            s = t.info["arpo_branch_step"]
            end = t.steps[s - 1].segment + 2
            prefix = [tok for seg in t.segments[:end] for tok in seg.token_ids]
            assert any(o is not t and o.token_ids[: len(prefix)] == prefix for o in rows)
    before = {k: v.detach().clone() for k, v in tr.policy.named_parameters()}
    m = tr.step(0)
    assert torch.isfinite(torch.tensor(m["train/loss"])) and m["arpo/branches"] + m["arpo/fresh_rows"] == 4
    assert any(not torch.equal(before[k], v) for k, v in tr.policy.named_parameters())


class Scripted:
    """A generator that searches first and then answers, with scripted entropies: ``first`` per token at an
    episode's first step, ``later`` at the steps after an observation (a batched generator: one call per turn)."""

    def __init__(self, tok, first, later):
        self.tok, self.first, self.later = tok, first, later
        self.calls = 0

    def generate(self, prompts, params, cache_keys=None):
        from searchrl.rollout.generator import Generation

        out = []
        for p in prompts:
            searched = "<information>" in self.tok.decode(p)
            text = "<answer> x </answer>" if searched else f"<search> q{self.calls} </search>"
            self.calls += 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            h = self.later if searched else self.first
            ent = [h] * min(params.entropy_tokens, len(ids)) if params.entropy_tokens else None
            out.append(Generation(ids, [-0.5] * len(ids), "stop", entropy=ent))
        return out

    def release(self, cache_keys=None):
        pass


@pytest.mark.parametrize(("later", "branches"), [(5.0, 2), (0.1, 0)])
def test_collect_branches_where_entropy_rose(tiny_model_dir, world_bm25, small_world, later, branches):
    """Chains search, read the documents, answer. With β large and τ 0 a candidate branches exactly when the
    entropy after the tool response rose over the chain's first step's (ΔH > 0): entropy 1 → 5 branches each
    chain once (M − N = 2 branches: from the search's observation, the chain's own tokens, then a new answer);
    1 → 0.1 branches none, and two fresh chains fill the budget."""
    from searchrl.algorithms.arpo import ARPO
    from searchrl.algorithms.base import Context
    from searchrl.envs.search import SearchEnv
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    cfg = ARPOConfig(
        group_size=4, initial_rollouts=2, beam_size=2, branch_probability=0.0, entropy_weight=1e6
    )
    ctx = Context(
        env,
        Scripted(tok, 1.0, later),
        tok,
        lambda trajs: {},
        SamplingParams(1.0, 1.0, 16),
        512,
        small_world.examples("train")[:1],
    )
    rows, m = ARPO(cfg, ctx).collect([0])
    assert len(rows) == 4 and m["arpo/branches"] == branches and m["arpo/fresh_rows"] == 2 - branches
    assert m["arpo/branch_points"] == 2  # one observation per chain
    chains, rest = rows[:2], rows[2:]
    for kid in rest:
        if branches:
            assert kid.info["arpo_branch_step"] == 1
            node = [tok for seg in kid.segments[:3] for tok in seg.token_ids]  # prompt, search, documents
            assert any(c.token_ids[: len(node)] == node for c in chains)
            assert [s.kind for s in kid.segments] == ["prompt", "action", "observation", "action"]
        else:
            assert "arpo_branch_step" not in kid.info and kid.state.actions[0].startswith("<search>")
        assert kid.state.done and kid.episode.answer == "x"
