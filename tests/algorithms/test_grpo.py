import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms.advantage_math import broadcast_to_tokens, grpo_outcome
from searchrl.algorithms.grpo import GRPO, GRPOConfig
from searchrl.algorithms.loss_terms import clipped_policy_loss
from searchrl.core.types import BatchExtras, RolloutBatch


def test_group_advantage_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 1, 1])
    adv = grpo_outcome(r, g, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0]).std().item()  # unbiased: sqrt(1/3)
    assert adv[:3].tolist() == pytest.approx([(1 - 1 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])
    assert adv[3:].tolist() == [0.0, 0.0]  # identical rewards: no signal
    assert grpo_outcome(r, g, std_normalize=False)[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=20))
def test_group_advantage_properties(pairs):
    g = torch.tensor([p[0] for p in pairs])
    r = torch.tensor([p[1] for p in pairs])
    adv = grpo_outcome(r, g)
    for gid in g.unique():
        a = adv[g == gid]
        assert abs(float(a.mean())) < 1e-4  # zero mean within each group
        if a.numel() > 1 and float(r[g == gid].std()) > 1e-3:
            assert abs(float(a.std()) - 1.0) < 1e-2  # unit std
    # ranking within a group follows rewards
    for i in range(len(pairs)):
        for j in range(len(pairs)):
            if g[i] == g[j] and r[i] > r[j] + 1e-6:
                assert adv[i] > adv[j]


def test_clipped_loss_hand_computed():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.1]]))  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = clipped_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.3)
    # ratio 1.5, A>0: clipped to 1.3; ratio 0.5, A<0: clipped to 0.8 -> -min(-0.5, -0.8) = 0.8
    assert loss.tolist()[0] == pytest.approx([-1.0, -1.3, 0.8, 1.1])
    assert m["clip_frac"].tolist()[0] == [0.0, 1.0, 1.0, 0.0]


def test_dual_clip_caps_negative_advantage_losses_only():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0, 0.5]]))  # ratios
    adv = torch.tensor([[-1.0, -1.0, 2.0, -2.0]])
    plain, _ = clipped_policy_loss(logp, old, adv)
    assert plain.tolist()[0] == pytest.approx([5.0, 2.0, -2.4, 1.6])  # eq. 1
    loss, m = clipped_policy_loss(logp, old, adv, dual_clip=3.0)
    # ratio 5 at A = −1: the loss 5 is capped at −3·A = 3; ratio 2 (loss 2 < 3) and A > 0 are untouched
    assert loss.tolist()[0] == pytest.approx([3.0, 2.0, -2.4, 1.6])
    assert m["dual_clip_frac"].tolist()[0] == [1.0, 0.0, 0.0, 0.0]


def test_log_ratio_is_held_to_20_before_the_exp():
    logp, old = torch.tensor([[0.0]]), torch.tensor([[-200.0]])  # exp(200) would overflow float32
    loss, m = clipped_policy_loss(logp, old, torch.tensor([[-1.0]]))
    assert torch.isfinite(loss).all() and m["ratio"].item() == pytest.approx(math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize(("key", "value"), [("dual_clip", 1.0), ("kl_clamp", 0.0)])
def test_stabilisers_are_checked_in_the_config(key, value):
    from searchrl.core.config import from_dict
    from searchrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        from_dict(GRPOConfig, {key: value}, "exp.yaml", "algorithm")
    assert getattr(from_dict(GRPOConfig, {key: 3.0}), key) == 3.0


def _batch(rewards, groups, old, ref):
    B, T = old.shape
    mask = torch.ones(B, T)
    mask[:, 0] = 0
    return RolloutBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=mask,
        obs_mask=torch.zeros(B, T, dtype=torch.bool),
        step_ids=torch.full((B, T), -1),
        step_ends=torch.zeros(B, 1, dtype=torch.long),
        step_mask=torch.zeros(B, 1, dtype=torch.bool),
        sampled_logprobs=torch.zeros(B, T),
        rewards=torch.tensor(rewards),
        step_rewards=torch.zeros(B, 1),
        pair_ids=torch.full((B,), -1),
        chosen=torch.zeros(B, dtype=torch.bool),
        group_ids=torch.tensor(groups),
        extras=BatchExtras(old_logp=old * mask, ref_logp=ref * mask),
    )


def test_grpo_loss_equals_eq1_by_hand():
    """ReSearch eq. 1 on one group: token loss = -(A_i ρ) + β k3, at ρ = 1 the gradient is -A_i ∂logp."""
    old = torch.full((2, 3), -1.0)
    ref = torch.full((2, 3), -1.2)
    b = _batch([1.0, 0.0], [0, 0], old, ref)
    algo = GRPO(GRPOConfig(kl_coef=0.1), ctx=None)
    algo.prepare(b)
    a = 1 / torch.tensor([1.0, 0.0]).std().item() * 0.5  # (1 - 0.5) / std
    assert b.extras.advantages[0, 1:].tolist() == pytest.approx([a, a], rel=1e-5)
    logp = old.clone().requires_grad_(True)
    loss, metrics = algo.loss(logp, None, b)
    k3 = math.exp(-1.2 + 1.0) - 1 - (-1.2 + 1.0)
    assert loss[0, 1].item() == pytest.approx(-a + 0.1 * k3, rel=1e-5)
    assert loss[1, 1].item() == pytest.approx(a + 0.1 * k3, rel=1e-5)
    assert metrics["kl"][0, 1].item() == pytest.approx(k3, rel=1e-5)


def test_grpo_kl_in_reward():
    old = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    ref = torch.tensor([[0.0, -2.0, -2.0], [0.0, -1.0, -1.0]])
    b = _batch([1.0, 1.0], [0, 0], old, ref)
    algo = GRPO(GRPOConfig(kl_coef=0.5, kl_in="reward", kl_estimator="k1"), ctx=None)
    algo.prepare(b)
    # r0 = 1 - 0.5 * (1 + 1) = 0, r1 = 1 -> the first is below its group mean
    adv = b.extras.advantages
    assert adv[0, 1] < 0 < adv[1, 1]
    _, metrics = algo.loss(old.clone(), None, b)
    assert "kl" not in metrics  # not also in the loss


def test_broadcast_respects_mask():
    m = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    assert broadcast_to_tokens(torch.tensor([2.0]), m).tolist() == [[0.0, 2.0, 0.0, 2.0]]


def test_sft_targets_actions_or_everything(tiny_model_dir):
    from searchrl.algorithms.sft import record_to_trajectory
    from searchrl.core.masking import build_batch
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    rec = {
        "prompt": "Question: q?\n",
        "actions": ["<search> a </search>", "<answer> b </answer>"],
        "observations": ["\n<information>doc</information>\n", ""],
    }
    acts = build_batch([record_to_trajectory(rec, tok)], tok.pad_token_id)
    n_act = sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in rec["actions"])
    assert acts.loss_mask.sum() == n_act and acts.obs_mask.any()
    lm = build_batch([record_to_trajectory(rec, tok, all_tokens=True)], tok.pad_token_id)
    assert lm.loss_mask.sum() == lm.attention_mask.sum() and not lm.obs_mask.any()
    assert lm.input_ids.tolist() == acts.input_ids.tolist()


def test_sft_leaves_the_prompt_start_every_record_shares_as_context(tiny_model_dir):
    """loss_on all_but_common_prefix: the system prompt every record starts with is context; the rest of the
    prompt (the question), the actions and the documents are targets."""
    from searchrl.algorithms.sft import common_prefix, record_to_trajectory
    from searchrl.core.masking import build_batch
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    system = "You answer questions. Tools: search(query).\n"
    recs = [
        {
            "prompt": system + q,
            "actions": ["<search> a </search>", "<answer> b </answer>"],
            "observations": ["\n<information>doc</information>\n", ""],
        }
        for q in ("Question: who?\n", "Question: where?\n")
    ]
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in recs]
    shared = common_prefix(ids)
    assert ids[0][:shared] == ids[1][:shared] and ids[0][shared] != ids[1][shared]
    assert len(tok(system, add_special_tokens=False)["input_ids"]) <= shared + 1  # a merge may span the seam
    for rec in recs:
        lm = build_batch([record_to_trajectory(rec, tok, all_tokens=True)], tok.pad_token_id)
        cut = build_batch(
            [record_to_trajectory(rec, tok, all_tokens=True, context_prefix=shared)], tok.pad_token_id
        )
        assert cut.input_ids.tolist() == lm.input_ids.tolist()
        mask = cut.loss_mask[0][cut.attention_mask[0].bool()]
        assert not mask[:shared].any() and mask[shared:].all()
        assert int(mask.sum()) == int(lm.loss_mask.sum()) - shared
    assert common_prefix(ids[:1]) == 0 and common_prefix([ids[0], ids[0]]) == 0


def test_sft_drops_the_shared_prompt_start_from_a_share_of_records(tiny_model_dir):
    """drop_common_prefix: that share of records (the same draw every run) starts after the shared system
    prompt, the others keep it whole; with all_but_common_prefix the kept prompt start is context."""
    from searchrl.algorithms.base import Context
    from searchrl.algorithms.sft import SFT, SFTConfig, common_prefix
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    recs = [
        {
            "prompt": f"System: search, then answer.\nQuestion {i}: who?\n",
            "actions": ["<answer> b </answer>"],
            "observations": [""],
        }
        for i in range(200)
    ]
    shared = common_prefix([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in recs])
    full = [tok(r["prompt"] + r["actions"][0], add_special_tokens=False)["input_ids"] for r in recs]

    def build(**kw):
        ctx = Context(None, None, tok, None, None, 64, [], records=recs)
        return SFT(SFTConfig(**kw), ctx).trajs

    for kw in ({"loss_on": "all"}, {"loss_on": "all_but_common_prefix"}):
        trajs = build(drop_common_prefix=0.5, **kw)
        dropped = [t.token_ids == ids[shared:] for t, ids in zip(trajs, full)]
        assert all(d or t.token_ids == ids for d, t, ids in zip(dropped, trajs, full))
        assert 70 <= sum(dropped) <= 130
        for d, t in zip(dropped, trajs):
            targets = sum(len(s.token_ids) for s in t.segments if s.kind == "action")
            keep_context = kw["loss_on"] == "all_but_common_prefix" and not d
            assert targets == len(t.token_ids) - (shared if keep_context else 0)
        assert dropped == [
            t.token_ids == ids[shared:] for t, ids in zip(build(drop_common_prefix=0.5, **kw), full)
        ]
    assert all(t.token_ids == ids for t, ids in zip(build(loss_on="all"), full))
    assert all(
        t.token_ids == ids[shared:] for t, ids in zip(build(loss_on="all", drop_common_prefix=1.0), full)
    )


def test_sft_keeps_a_prompt_that_is_all_shared_prefix_whole(tiny_model_dir):
    """A prompt that another starts with is all common prefix: dropped, its row would start from nothing."""
    from searchrl.algorithms.sft import common_prefix, record_to_trajectory
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    recs = [
        {"prompt": p, "actions": ["<answer> b </answer>"], "observations": [""]} for p in ("Q:", "Q: more")
    ]
    shared = common_prefix([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in recs])
    whole = record_to_trajectory(recs[0], tok, all_tokens=True)
    assert shared == len(whole.segments[0].token_ids)
    assert (
        record_to_trajectory(recs[0], tok, all_tokens=True, drop_prefix=shared).token_ids == whole.token_ids
    )
