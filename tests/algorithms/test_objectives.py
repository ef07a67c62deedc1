"""The advantage estimators and policy losses of `algorithm.advantage` / `algorithm.policy_loss`: each against a
hand-computed case from its paper, and against an independent reference written the way verl
(`verl/trainer/ppo/core_algos.py`) or TRL (`GRPOTrainer._compute_loss`) write it, on random inputs."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms import ADVANTAGES, POLICY_LOSSES
from searchrl.algorithms.advantage_estimators import (
    AdvantageInput,
    global_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    rloo_outcome,
)
from searchrl.algorithms.grpo import GRPOConfig
from searchrl.algorithms.objective import estimator_of
from searchrl.algorithms.policy_losses import cispo, clip, gmpo, gspo, gspo_token

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics

CFG = SimpleNamespace(clip_low=0.2, clip_high=0.2, dual_clip=None, std_normalize=True, eps=1e-6)


def cfg(**kw):
    return SimpleNamespace(**{**vars(CFG), **kw})


def rand_inputs(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # contiguous action tokens, then padding
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g)
    rewards = torch.randint(0, 3, (B,), generator=g).float() / 2
    return mask, old, logp, rewards


# ------------------------------------------------------------------------------------------- estimators


def test_rloo_hand_computed_and_verl():
    r, gid = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), torch.tensor([0, 0, 0, 0, 1, 1])
    adv = rloo_outcome(r, gid)
    # A_0 = 1 − (0 + 0 + 1) / 3, A_1 = 0 − (1 + 0 + 1) / 3
    assert adv[:4].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert adv[4:].tolist() == [0.0, 0.0]
    # verl compute_rloo_outcome_advantage: r·n/(n−1) − mean·n/(n−1)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        r = torch.rand(12, generator=g)
        gid = torch.arange(12) // 4
        ref = torch.zeros(12)
        for k in range(3):
            i = gid == k
            ref[i] = r[i] * 4 / 3 - r[i].mean() * 4 / 3
        assert (rloo_outcome(r, gid) - ref).abs().max() < 1e-6


def test_reinforce_pp_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])  # an observation token between two actions, then padding
    kl = torch.tensor([[0.1, 0.2, 5.0, 0.3, 9.0]])  # β·KL_t (off-mask values must not count)
    x = AdvantageInput(torch.tensor([1.0]), torch.tensor([0]), mask, kl, CFG)
    out = reinforce_pp(x)
    # reward-to-go over the action tokens: 1 − 0.3 = 0.7 at t3, 0.7 − 0.2 = 0.5 at t1, 0.5 − 0.1 = 0.4 at t0
    g = torch.tensor([0.4, 0.5, 0.7])
    expected = (g - g.mean()) / g.std()
    assert out[0, [0, 1, 3]].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert out[0, [2, 4]].tolist() == [0.0, 0.0]


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def test_reinforce_pp_equals_verl_on_random_inputs():
    worst = 0.0
    for seed in range(10):
        mask, _old, _logp, rewards = rand_inputs(seed)
        kl = 0.01 * torch.rand_like(mask)
        x = AdvantageInput(rewards, torch.arange(len(rewards)), mask, kl, CFG)
        # verl compute_reinforce_plus_plus_outcome_advantage (γ = 1) on token_level_rewards = score at the
        # last response token − β·KL (use_kl_in_reward)
        last = mask.sum(-1).long() - 1
        tok = -kl * mask
        tok[torch.arange(len(rewards)), last] += rewards
        returns, running = torch.zeros_like(tok), torch.zeros(len(rewards))
        for t in reversed(range(tok.shape[1])):
            running = tok[:, t] + running
            returns[:, t] = running
            running = running * mask[:, t]
        ref = verl_masked_whiten(returns, mask) * mask
        worst = max(worst, float((reinforce_pp(x) - ref).abs().max()))
    assert worst < 1e-5


def test_reinforce_pp_baseline_equals_verl():
    for seed in range(5):
        mask, _, _, rewards = rand_inputs(seed, B=8)
        gid = torch.arange(8) // 4
        x = AdvantageInput(rewards, gid, mask, None, CFG)
        scores = rewards.clone()
        for k in range(2):
            scores[gid == k] -= rewards[gid == k].mean()
        ref = verl_masked_whiten(scores[:, None] * mask, mask) * mask
        assert (reinforce_pp_baseline(x) - ref).abs().max() < 1e-5


def test_global_whitening_is_global_over_processes():
    """Two processes holding the same half: their sums double, and each half's result must equal the
    whitening of the union (a per-process whitening would divide by n − 1 of the half, not of the union)."""
    mask, _, logp, _ = rand_inputs(3)
    union = global_whiten(torch.cat([logp, logp]), torch.cat([mask, mask]))
    half = global_whiten(logp, mask, sum_all=lambda v: 2 * v)
    assert (half - union[: len(logp)]).abs().max() < 1e-6
    assert (global_whiten(logp, mask) - half).abs().max() > 1e-4  # the per-process value differs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-3, 3)), min_size=2, max_size=16))
def test_rloo_properties(pairs):
    gid = torch.tensor([p[0] for p in pairs])
    r = torch.tensor([p[1] for p in pairs])
    adv = rloo_outcome(r, gid)
    for k in gid.unique():
        a, rr = adv[gid == k].double(), r[gid == k].double()
        if len(a) > 1:
            assert abs(float(a.sum())) < 1e-4  # zero mean: n/(n−1)·(r − mean) sums to 0
            assert (a - (rr - rr.mean()) * len(a) / (len(a) - 1)).abs().max() < 1e-4
        else:
            assert float(a[0]) == 0.0


def test_estimators_are_zero_off_the_mask_and_registered():
    mask, _, _, rewards = rand_inputs(1, B=8)
    x = AdvantageInput(rewards, torch.arange(8) // 4, mask, 0.01 * torch.rand_like(mask), CFG)
    for name in ADVANTAGES.names():
        if (
            estimator_of(name).level == "turn"
        ):  # they read a batch's steps: a scripted batch (tests/algorithms/test_turn_credit.py)
            from tests.algorithms.test_turn_credit import scripted, with_beliefs

            batch = with_beliefs(scripted()[1])
            cfg = GRPOConfig(advantage=name)
            xs = AdvantageInput(batch.rewards, batch.group_ids, batch.loss_mask, None, cfg, float, batch)
            out, m = ADVANTAGES.get(name)(xs), batch.loss_mask
            assert out.shape == m.shape and float((out * (1 - m)).abs().sum()) == 0.0, name
            continue
        out = ADVANTAGES.get(name)(x)
        assert out.shape == mask.shape and float((out * (1 - mask)).abs().sum()) == 0.0, name
    assert rloo(x)[0, 0] == pytest.approx(float(rloo_outcome(x.penalised(), x.group_ids)[0]))


# ------------------------------------------------------------------------------------------- policy losses


def test_gspo_hand_computed():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 7.0], [0.1, 0.3, 7.0]])  # the third token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0], [-1.0]]) * mask
    loss, m = gspo(logp, old, adv, mask, CFG)
    s = torch.exp(torch.tensor(0.2)).item()  # exp(mean(0.1, 0.3)) = 1.2214 > 1 + 0.2
    assert loss[0, :2].tolist() == pytest.approx([-1.2, -1.2])  # A > 0: clipped at 1.2
    assert loss[1, :2].tolist() == pytest.approx([s, s])  # A < 0: −min(−s, −1.2) = s
    assert m["clip_frac"][0, :2].tolist() == [1.0, 1.0] and m["clip_frac"][1, :2].tolist() == [0.0, 0.0]


def test_gspo_equals_trl_sequence_level_and_gspo_token_has_its_gradient():
    """TRL importance_sampling_level='sequence': coef_1 = exp(Σ m·log ρ / Σ m), −min(coef_1 A, clip(coef_1) A).
    GSPO-token with one advantage per sequence has the same value and, aggregated per sequence, the same
    gradient (GSPO §4.3)."""
    for seed in range(5):
        mask, old, logp0, rewards = rand_inputs(seed)
        adv = (rewards - rewards.mean())[:, None] * mask
        c = cfg(clip_low=3e-2, clip_high=4e-2)
        grads = []
        for fn in (gspo, gspo_token):
            logp = logp0.clone().requires_grad_(True)
            loss, _ = fn(logp, old, adv, mask, c)
            per_seq = (loss * mask).sum(-1) / mask.sum(-1)
            per_seq.mean().backward()
            grads.append(logp.grad.clone())
            coef_1 = torch.exp(((logp0 - old) * mask).sum(-1) / mask.sum(-1))[:, None]
            ref = -torch.min(coef_1 * adv, torch.clamp(coef_1, 1 - 3e-2, 1 + 4e-2) * adv)
            assert ((loss.detach() - ref) * mask).abs().max() < 1e-6
        assert (grads[0] - grads[1]).abs().max() < 1e-6


def test_cispo_hand_computed_and_trl():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))  # ρ = 2, 1, 0.5
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    loss, m = cispo(logp, old, adv, mask, CFG)
    loss.sum().backward()
    # weights clip(ρ, 0.8, 1.2) = 1.2, 1, 0.8, held constant: ∂ℓ/∂logp = −w·A, a gradient on every token
    assert logp.grad.tolist()[0] == pytest.approx([-1.2, -1.0, -0.8])
    assert loss.tolist()[0] == pytest.approx(
        [-1.2 * logp[0, 0].item(), -logp[0, 1].item(), -0.8 * logp[0, 2].item()]
    )
    assert m["clip_frac"].tolist()[0] == [1.0, 0.0, 1.0]
    # TRL loss_type='cispo': −clamp(ρ, max=ε_high).detach()·A·logp, a one-sided bound (ours with ε_low → 1)
    for seed in range(5):
        mask, old, logp0, _rewards = rand_inputs(seed)
        adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
        ours, _ = cispo(logp0, old, adv, mask, cfg(clip_low=0.999999, clip_high=4.0))
        ref = -torch.clamp(torch.exp(logp0 - old), max=5.0) * adv * logp0
        assert (ours - ref).abs().max() < 1e-5


def verl_geo_mean(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high):
    """verl core_algos compute_policy_loss_gmpo ('geo_mean'), written as there."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    negative_approx_kl_min = torch.min(
        sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp
    )
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


def test_gmpo_hand_computed_and_verl():
    old, mask = torch.zeros(2, 2), torch.ones(2, 2)
    logp = torch.tensor([[0.5, -0.1], [0.5, -0.1]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _ = gmpo(logp, old, adv, mask, cfg(clip_low=0.4, clip_high=0.4))
    # A > 0: log ρ → min(log ρ, clip) = (0.4, −0.1), mean 0.15; A < 0: max(log ρ, clip) = (0.5, −0.1), mean 0.2
    assert loss[0].tolist() == pytest.approx([-torch.exp(torch.tensor(0.15)).item()] * 2)
    assert loss[1].tolist() == pytest.approx([torch.exp(torch.tensor(0.2)).item()] * 2)
    worst_v = worst_g = 0.0
    for seed in range(8):
        m, o, lp0, rewards = rand_inputs(seed)
        a = (rewards - rewards.mean())[:, None] * m  # one advantage per sequence, as verl requires
        lp1, lp2 = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
        ours, _ = gmpo(lp1, o, a, m, cfg(clip_low=0.4, clip_high=0.4))
        ours_mean = ((ours * m).sum(-1) / m.sum(-1)).mean()  # loss_agg seq-mean-token-mean
        ref = verl_geo_mean(lp2, o, a, m, 0.4, 0.4)
        ours_mean.backward()
        ref.backward()
        worst_v = max(worst_v, abs(float((ours_mean - ref).detach())))
        worst_g = max(worst_g, float((lp1.grad - lp2.grad).abs().max()))
    assert worst_v < 1e-5 and worst_g < 1e-5


def test_clip_is_the_papers_loss_and_every_loss_is_registered():
    mask, old, logp, rewards = rand_inputs(0)
    adv = (rewards - rewards.mean())[:, None] * mask
    from searchrl.algorithms.loss_terms import clipped_policy_loss

    assert torch.equal(clip(logp, old, adv, mask, CFG)[0], clipped_policy_loss(logp, old, adv)[0])
    for name in POLICY_LOSSES.names():
        loss, metrics = POLICY_LOSSES.get(name)(logp, old, adv, mask, CFG)
        assert loss.shape == mask.shape and {"clip_frac", "approx_kl", "ratio"} <= set(metrics), name
        assert all(v.shape == mask.shape for v in metrics.values()), name


def test_losses_agree_at_rho_one_on_the_policy_gradient():
    """At π_θ = π_old every loss's gradient is −A·∇log π (per token, or per sequence mean for GSPO/GMPO)."""
    mask, old, _, rewards = rand_inputs(2)
    adv = (rewards - rewards.mean())[:, None] * mask
    for name in ("clip", "cispo", "gspo_token"):
        logp = old.clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES.get(name)(logp, old, adv, mask, CFG)
        (loss * mask).sum().backward()
        assert (logp.grad - (-adv * mask)).abs().max() < 1e-6, name
