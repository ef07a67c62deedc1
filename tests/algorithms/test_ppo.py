"""PPO maths: GAE over action tokens only, token reward placement, value clipping, KL in the reward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms.advantage_math import gae, token_rewards
from searchrl.algorithms.base import Context
from searchrl.algorithms.ppo import PPO, AdaptiveKL, PPOConfig, clipped_value_loss
from searchrl.core.types import BatchExtras, RolloutBatch


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain loops: walk each row's action tokens backwards, ignoring everything else."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        running, next_v = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_v = float(values[b, t])
    return adv, (adv + values.double()) * mask


def random_case(seed, B=3, T=12):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.6).float()
    mask[:, 0] = 0  # the prompt
    return torch.randn(B, T, generator=g), torch.randn(B, T, generator=g), mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (1.0, 0.0)])
def test_gae_matches_a_plain_loop(gamma, lam):
    for seed in range(5):
        r, v, m = random_case(seed)
        adv, ret = gae(r, v, m, gamma, lam)
        ref_adv, ref_ret = reference_gae(r, v, m, gamma, lam)
        assert torch.allclose(adv.double(), ref_adv, atol=1e-5)
        assert torch.allclose(ret.double(), ref_ret, atol=1e-5)
        assert (adv[m == 0] == 0).all()


def test_gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0.0]])  # prompt, action, action, obs, obs, action, action, pad
    r = torch.tensor([[0, 0.5, 0, 9, 9, -1, 2, 7.0]])  # 9 and 7 sit on masked positions: never read
    adv, ret = gae(r, torch.zeros_like(r), mask, 1.0, 1.0)
    assert adv.tolist() == [[0, 1.5, 1.0, 0, 0, 1.0, 2.0, 0]]
    assert torch.equal(adv, ret)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_anything_written_at_observation_positions_changes_nothing(seed, gamma, lam):
    r, v, m = random_case(seed)
    adv, ret = gae(r, v, m, gamma, lam)
    g = torch.Generator().manual_seed(seed + 1)
    noise_r, noise_v = torch.randn(r.shape, generator=g) * 100, torch.randn(v.shape, generator=g) * 100
    adv2, ret2 = gae(r + noise_r * (1 - m), v + noise_v * (1 - m), m, gamma, lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_token_rewards_put_outcome_last_and_steps_at_step_ends():
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 0.0], [0, 0, 1, 1, 1, 0, 0, 0]])
    step_ends = torch.tensor([[2, 5], [4, 0]])
    step_mask = torch.tensor([[True, True], [True, False]])
    out = token_rewards(
        torch.tensor([1.0, 0.5]), torch.tensor([[0.2, -0.3], [0.4, 9.0]]), step_ends, step_mask, loss_mask
    )
    expected = torch.tensor([[0, 0, 0.2, 0, 0, 0.7, 0, 0], [0, 0, 0, 0, 0.9, 0, 0, 0]])
    assert torch.allclose(out, expected)


def test_clipped_value_loss_by_hand():
    old = torch.tensor([0.0, 0.0, 1.0])
    new = torch.tensor([0.5, -0.1, 0.5])
    ret = torch.tensor([1.0, 1.0, 0.0])
    loss, m = clipped_value_loss(new, old, ret, clip=0.2)
    # token 0: clipped to 0.2 -> (0.2-1)^2 = 0.64 > (0.5-1)^2 = 0.25, pessimistic max -> 0.32
    # token 1: inside the clip range -> 0.5 * 1.21
    # token 2: clipped to 0.8 -> 0.64 > 0.25 -> 0.32
    assert loss.tolist() == pytest.approx([0.32, 0.605, 0.32])
    assert m["value_clip_frac"].tolist() == [1.0, 0.0, 1.0]
    assert clipped_value_loss(new, old, ret, clip=0.0)[0].tolist() == pytest.approx([0.125, 0.605, 0.125])


def batch_for(rewards, old_logp, ref_logp, loss_mask, values=None):
    B, T = loss_mask.shape
    return RolloutBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=loss_mask,
        obs_mask=torch.zeros(B, T, dtype=torch.bool),
        step_ids=torch.zeros(B, T, dtype=torch.long),
        step_ends=torch.zeros(B, 1, dtype=torch.long),
        step_mask=torch.zeros(B, 1, dtype=torch.bool),
        sampled_logprobs=old_logp,
        rewards=rewards,
        step_rewards=torch.zeros(B, 1),
        pair_ids=torch.full((B,), -1),
        chosen=torch.zeros(B, dtype=torch.bool),
        group_ids=torch.arange(B),
        extras=BatchExtras(
            old_logp=old_logp,
            ref_logp=ref_logp,
            old_values=values if values is not None else torch.zeros(B, T),
        ),
    )


def algo(**kw):
    ctx = Context(
        env=None,
        generator=None,
        tokenizer=None,
        rewards=None,
        sampling=None,
        max_total_tokens=8,
        train_examples=[],
    )
    return PPO(PPOConfig(**kw), ctx)


def test_kl_penalty_is_a_per_token_reward():
    mask = torch.tensor([[0, 1, 1, 0, 1.0]])
    old = torch.tensor([[0, -1.0, -2.0, 0, -0.5]])
    ref = torch.tensor([[0, -1.5, -1.0, 0, -0.5]])  # k1 = old - ref = [., 0.5, -1.0, ., 0]
    b = batch_for(torch.tensor([1.0]), old, ref, mask)
    metrics = algo(kl_coef=0.1, kl_estimator="k1", kl_in="reward", whiten_advantages=False).prepare(b)
    # rewards per action token: -0.05, +0.1, 1 - 0 -> reward-to-go: 1.05, 1.1, 1.0
    assert b.extras.advantages.tolist()[0] == pytest.approx([0, 1.05, 1.1, 0, 1.0])
    assert metrics["kl/sequence"] == pytest.approx(-0.5)
    b2 = batch_for(torch.tensor([1.0]), old, ref, mask)
    algo(kl_coef=0.1, kl_in="loss", whiten_advantages=False).prepare(b2)
    assert b2.extras.advantages.tolist()[0] == pytest.approx([0, 1.0, 1.0, 0, 1.0])


def test_whitened_advantages_have_zero_mean_unit_std_on_actions():
    r, v, m = random_case(3, B=4, T=10)
    b = batch_for(r[:, 0], torch.zeros_like(r), torch.zeros_like(r), m, values=v * m)
    algo(kl_coef=0.0).prepare(b)
    a = b.extras.advantages[m.bool()]
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(a.var(unbiased=True)) == pytest.approx(1.0, rel=1e-3)  # verl's whitening (Search-R1)
    assert (b.extras.advantages[m == 0] == 0).all()


def test_critic_warmup_zeroes_the_policy_loss_only():
    mask = torch.tensor([[0, 1, 1.0]])
    b = batch_for(torch.tensor([1.0]), torch.zeros(1, 3), torch.zeros(1, 3), mask)
    a = algo(kl_coef=0.0, critic_warmup_steps=2, whiten_advantages=False)
    a.prepare(b)
    logp = torch.tensor([[0, -0.1, -0.2]])
    values = torch.tensor([[0, 0.3, 0.4]])
    a.step = 1
    loss, m = a.loss(logp, None, b, values)
    assert (m["pg_loss"] == 0).all() and torch.allclose(loss, 0.5 * m["value_loss"])
    a.step = 2
    _, m = a.loss(logp, None, b, values)
    assert (m["pg_loss"][mask.bool()] != 0).all()


def test_adaptive_kl_moves_towards_the_target_and_is_resumable():
    kl = AdaptiveKL(0.1, target=0.01, horizon=100)
    kl.update(0.05, n=10)  # KL above target: error clipped to +0.2 -> β * (1 + 0.2 * 0.1)
    assert kl.value == pytest.approx(0.102)
    kl.update(0.0, n=10)  # below: -0.2
    assert kl.value == pytest.approx(0.102 * 0.98)
    a = algo(kl_coef=0.1, adaptive_kl=True)
    a.kl.value = 0.37
    b = algo(kl_coef=0.1, adaptive_kl=True)
    b.load_state_dict(a.state_dict())
    assert b.kl_coef == 0.37


def test_critic_gets_its_own_learning_rate():
    from searchrl.models.policy import PolicyWithValue

    lm = torch.nn.Module()
    lm.config = type("C", (), {"hidden_size": 4})()
    lm.w = torch.nn.Parameter(torch.zeros(2))
    groups = PPO.param_groups(PPOConfig(critic_lr=None), PolicyWithValue(lm), lr=1e-4)
    assert [len(g["params"]) for g in groups] == [1, 2] and groups[1]["lr"] == pytest.approx(1e-3)
    assert math.isclose(PPO.param_groups(PPOConfig(critic_lr=5e-5), PolicyWithValue(lm), 1e-4)[1]["lr"], 5e-5)
