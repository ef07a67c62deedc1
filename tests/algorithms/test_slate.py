"""SLATE: step-group advantages, selection, the bonus, the loss mask, and a 2-step episode by hand."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms.base import Context
from searchrl.algorithms.slate import SLATE, SLATEConfig, select, step_advantages, step_reward
from searchrl.core.functional import token_logprobs, token_weights
from searchrl.core.masking import build_batch
from searchrl.envs.search import SearchEnv
from searchrl.models import load_model_and_tokenizer
from searchrl.rewards.judges import JudgeScores
from searchrl.rollout.generator import SamplingParams
from searchrl.rollout.loop import encode
from tests.helpers import ScriptedCandidates


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 2.1]), min_size=2, max_size=8))
def test_step_advantages_are_zero_mean_within_the_group(r):
    a = step_advantages(r)
    assert sum(a) == pytest.approx(0.0, abs=1e-6)
    if len(set(r)) > 1:
        mean = sum(r) / len(r)
        sd = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        assert a == pytest.approx([(x - mean) / (sd + 1e-6) for x in r])
    else:
        assert all(x == 0 for x in a)


def test_tiny_eta_selection_equals_best_of_k():
    rng = random.Random(0)
    for _ in range(50):
        r = [rng.choice([-2.0, -1.0, 0.0, 1.0, 2.0]) + 0.01 * j for j in range(5)]
        a = step_advantages(r)
        best = select(r, a, "best", 0.7, rng)
        assert best == max(range(5), key=lambda j: r[j])
        assert select(r, a, "weighted", 1e-4, rng) == best
    counts = [0, 0]  # a finite η explores: the worse candidate is picked sometimes
    for _ in range(400):
        counts[select([1.0, 0.0], step_advantages([1.0, 0.0]), "weighted", 0.7, rng)] += 1
    assert 0 < counts[1] < counts[0]


def test_early_termination_bonus():
    s = JudgeScores(think=1.0, answer=1.0)
    B, lam = 4, 0.1
    assert step_reward(s, "answer", 1, B, lam) == pytest.approx(2 + lam * 3 / 4)  # SLATE A.8's example
    assert step_reward(s, "answer", B, B, lam) == pytest.approx(2.0)  # zero at the budget
    assert step_reward(JudgeScores(think=1.0, query=-1.0), "search", 1, B, lam) == 0.0  # searches: none
    assert step_reward(JudgeScores(think=0.0, answer=-1.0), "invalid", 1, B, lam) == -1.0
    # an answer the environment rejected (text after it, two answers, empty) earns no early-finish bonus
    assert step_reward(s, "answer", 1, B, lam, valid=False) == pytest.approx(2.0)


@pytest.fixture
def toy(tiny_model_dir, world_bm25, small_world):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=1, max_turns=3)
    ex = next(e for e in small_world.examples("train") if e.n_hops == 1)
    hop = ex.hops[0]
    [[doc]] = world_bm25.search([hop.keys[0]], 1)
    assert doc.id == hop.gold_doc_id  # the gold key finds the gold document
    return tok, env, ex, hop


def test_two_step_episode_by_hand(toy):
    tok, env, ex, hop = toy
    good = f"<think> find {hop.gold_title} </think>\n<search> {hop.keys[0]} </search>"
    bad = "<think> hmm </think>\n<search> zzz qqq </search>"
    right = f"<think> it is {hop.answer} </think>\n<answer> {ex.answers[0]} </answer>"
    wrong = "<think> hmm </think>\n<answer> nobody </answer>"
    gen = ScriptedCandidates(tok, [[good, bad], [right, wrong]])
    ctx = Context(
        env=env,
        generator=gen,
        tokenizer=tok,
        rewards=None,
        sampling=SamplingParams(),
        max_total_tokens=400,
        train_examples=[ex],
    )
    algo = SLATE(SLATEConfig(k=2, selection="best", bonus=0.1), ctx)
    out, m = algo.collect([0])
    assert algo.requires(algo.cfg, env).samples_per_item == 2 * 4  # k * B slots (B = max_turns + 1)
    assert len(out) == 4  # two steps of two candidates; the trainer pads the unused slots
    s = [t for t in out if t.state is not None]
    assert len(s) == 4 and m["slate/candidates"] == 4
    # step 1: good = think names the hop's entity (+1) + query finds the unseen gold doc (+1) = 2;
    #         bad  = think names nothing of the chain (-1) + query finds no gold doc (-1) = -2
    # step 2 (after the good search): right = +1 (names the final answer) + 1 (EM) + 0.1 * (4 - 2) / 4;
    #         wrong = -1 + -1 + 0.05
    assert [t.reward for t in s] == pytest.approx([2.0, -2.0, 2.05, -1.95])
    assert s[0].group_id == s[1].group_id != s[2].group_id == s[3].group_id
    assert m["slate/em"] == 1.0 and m["slate/answered"] == 1.0 and m["slate/steps_per_question"] == 2.0
    # every sample: the prefix is context, only the candidate's own action carries loss
    batch = build_batch(out, tok.pad_token_id)
    for b, t in enumerate(out):
        n_action = len(t.segments[-1].token_ids) if t.state is not None else 0
        assert int(batch.loss_mask[b].sum()) == n_action
        if n_action:
            assert batch.loss_mask[b, len(t) - n_action : len(t)].all()
    # the second step's prefix holds the first (good) action and its observation, as context
    prompt = encode(tok, env.reset(ex).prompt)
    first_obs = encode(tok, s[2].state.observations[0])
    assert s[2].segments[0].token_ids == prompt + s[0].segments[1].token_ids + first_obs


def test_gradients_come_only_from_candidate_tokens(toy, tiny_model_dir):
    tok, env, ex, hop = toy
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    gen = ScriptedCandidates(
        tok, [[f"<think> a </think>\n<search> {hop.keys[0]} </search>"], ["<answer> x </answer>"]]
    )
    ctx = Context(
        env=env,
        generator=gen,
        tokenizer=tok,
        rewards=None,
        sampling=SamplingParams(),
        max_total_tokens=400,
        train_examples=[ex],
    )
    algo = SLATE(SLATEConfig(k=2, kl_coef=0.0), ctx)
    out, _ = algo.collect([0])
    batch = build_batch(out, tok.pad_token_id)
    batch.rewards = torch.linspace(-1, 1, len(out))
    batch.group_ids = torch.zeros(len(out), dtype=torch.long)  # one group, so advantages are non-zero
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.detach()
    logits.requires_grad_(True)
    logp = token_logprobs(logits, batch.input_ids, mask=batch.loss_mask)
    batch.extras.old_logp = logp.detach() - 0.01
    algo.prepare(batch)
    loss_tok, _ = algo.loss(logp, None, batch)
    w = token_weights(
        batch.loss_mask, algo.loss_agg, batch.loss_mask.sum(), (batch.loss_mask.sum(-1) > 0).sum(), 400
    )
    (loss_tok * w).sum().backward()
    has_grad = logits.grad.abs().sum(-1) > 0  # (B, T): logits at t predict token t + 1
    predicts_candidate = torch.zeros_like(has_grad)
    predicts_candidate[:, :-1] = batch.loss_mask[:, 1:].bool()
    assert has_grad.any() and torch.equal(has_grad, predicts_candidate & has_grad)
    assert not has_grad[~predicts_candidate].any()
