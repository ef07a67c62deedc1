# ruff: noqa: B023  (each lambda below is called at once, inside its loop iteration)
"""The policy losses exactly as their anchors write them (issue 49): GSPO and GMPO without a clamp of the token
log-ratios, GMPO's geometric-mean correction weight, SAPO, the configurations that would silently do
something else refused, DAPO's groups of one and answer criterion, verl's "drop rejected tokens" normaliser,
and the loss normalisation over micro-batches and processes. References are written the way verl
(`verl/trainer/ppo/core_algos.py`: compute_policy_loss_gspo, _sapo, _geo_mean, agg_loss) and TRL
(`GRPOTrainer._compute_loss`: importance_sampling_level, loss_type sapo) write them."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from searchrl.algorithms.dapo import DynamicSampling, informative
from searchrl.algorithms.grpo import GRPOConfig
from searchrl.algorithms.policy_losses import batch_policy_loss, gmpo, gspo, gspo_token, sapo
from searchrl.algorithms.ppo import PPOConfig
from searchrl.core.functional import token_weights
from searchrl.core.types import BatchExtras

from .test_objectives import rand_inputs, verl_geo_mean

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


def cfg(**kw):
    base = dict(
        clip_low=0.2, clip_high=0.28, dual_clip=None, policy_loss_args={"tau_pos": 1.0, "tau_neg": 1.05}
    )
    return SimpleNamespace(**{**base, **kw})


def seq_mean_token_mean(loss, mask):
    """verl's agg_loss 'seq-mean-token-mean' (one process, every sequence non-empty)."""
    return ((loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """verl compute_policy_loss_gspo, as written there (its aggregation is always seq-mean-token-mean)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    return seq_mean_token_mean(torch.maximum(pg_losses1, pg_losses2), response_mask)


def trl_sequence_level(per_token_logps, old_per_token_logps, advantages, mask, eps_low, eps_high):
    """TRL importance_sampling_level='sequence', loss_type 'grpo' (per-sequence token mean, then the mean)."""
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_sapo(per_token_logps, old_per_token_logps, advantages, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL loss_type='sapo' (token-level importance weights)."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    temperatures = torch.where(advantages > 0, tau_pos, tau_neg)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    per_token_loss = -soft_coef_1 * advantages
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos=1.0, tau_neg=1.05):
    """verl compute_policy_loss_sapo, as written there."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos), torch.as_tensor(tau_neg))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return seq_mean_token_mean(-gates * advantages, response_mask)


def ours(fn, logp, old, adv, mask, c):
    loss, _ = fn(logp, old, adv, mask, c)
    return seq_mean_token_mean(loss, mask)


def value_and_grad(f, logp0, *args):
    logp = logp0.clone().requires_grad_(True)
    v = f(logp, *args)
    v.backward()
    return float(v.detach()), logp.grad


# ------------------------------------------------------------------------------------------- GSPO


@pytest.mark.parametrize("fn", [gspo, gspo_token])
def test_gspo_hand_computed_stale_token_is_not_clamped(fn):
    """Issue 49's case: log ρ = [25, 0, 0], A = −1, clip 0.2 / 0.28: verl and TRL give e^{25/3} = 4160.3 and
    a gradient of e^{25/3} / 3 = 1386.8 on each token (a ±20 clamp per token gave e^{20/3} = 785.8)."""
    old = torch.zeros(1, 3)
    logp0 = torch.tensor([[25.0, 0.0, 0.0]])
    adv, mask = -torch.ones(1, 3), torch.ones(1, 3)
    v, g = value_and_grad(lambda lp: ours(fn, lp, old, adv, mask, cfg()), logp0)
    assert v == pytest.approx(math.exp(25 / 3), rel=1e-5)
    assert g.tolist()[0] == pytest.approx([math.exp(25 / 3) / 3] * 3, rel=1e-5)
    ref_v, ref_g = value_and_grad(lambda lp: verl_gspo(old, lp, adv, mask, 0.2, 0.28), logp0)
    assert v == pytest.approx(ref_v, rel=1e-6) and torch.allclose(g, ref_g, rtol=1e-6)


@pytest.mark.parametrize("scale", [0.3, 8.0])
def test_gspo_equals_verl_and_trl_on_random_inputs(scale):
    """Values and gradients, with ordinary and very stale log-ratios (scale 8: tokens beyond ±20)."""
    for seed in range(6):
        mask, old, logp0, rewards = rand_inputs(seed)
        logp0 = old + scale * (logp0 - old) / 0.3
        adv = (rewards - rewards.mean())[:, None] * mask
        c = cfg(clip_low=0.03, clip_high=0.04)
        for fn in (gspo, gspo_token):
            v, g = value_and_grad(lambda lp, fn=fn: ours(fn, lp, old, adv, mask, c), logp0)
            rv, rg = value_and_grad(lambda lp: verl_gspo(old, lp, adv, mask, 0.03, 0.04), logp0)
            assert v == pytest.approx(rv, rel=1e-5, abs=1e-6)
            assert torch.allclose(g, rg, rtol=1e-5, atol=1e-6)
        # TRL has no cap: equal where no sequence's mean log-ratio passes 10
        seq = ((logp0 - old) * mask).sum(-1) / mask.sum(-1)
        if bool((seq < 10).all()):
            v, g = value_and_grad(lambda lp: ours(gspo, lp, old, adv, mask, c), logp0)
            tv, tg = value_and_grad(lambda lp: trl_sequence_level(lp, old, adv, mask, 0.03, 0.04), logp0)
            assert v == pytest.approx(tv, rel=1e-5, abs=1e-6) and torch.allclose(g, tg, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- GMPO


def test_gmpo_takes_raw_log_ratios_as_verl():
    """A < 0 keeps the larger log-ratio: a stale token of log ρ 30 enters as 30 (verl leaves the ±20 clamp
    commented out): ratio e^{30/2}."""
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    logp0 = torch.tensor([[30.0, 0.0]])
    adv = -torch.ones(1, 2)
    v, g = value_and_grad(lambda lp: ours(gmpo, lp, old, adv, mask, cfg(clip_low=0.4, clip_high=0.4)), logp0)
    assert v == pytest.approx(math.exp(15.0), rel=1e-5)
    rv, rg = value_and_grad(lambda lp: verl_geo_mean(lp, old, adv, mask, 0.4, 0.4), logp0)
    assert v == pytest.approx(rv, rel=1e-5) and torch.allclose(g, rg, rtol=1e-5)


def verl_geo_mean_weighted(log_prob, old_log_prob, advantages, response_mask, clip, weights):
    """verl geo_mean with rollout_is_weights: the sequence's weight is the geometric mean of its tokens'."""
    negative_approx_kl = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -clip, clip)
    kl_min = sgn * torch.min(sgn * negative_approx_kl, sgn * clamped)
    n = response_mask.sum(dim=-1)
    ratio = torch.exp((kl_min * response_mask).sum(dim=-1) / (n + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (n + 1e-8)
    pg_losses = -advantage * ratio
    seq_w = torch.exp((torch.log(weights + 1e-10) * response_mask).sum(dim=-1) / (n + 1e-8))
    return torch.mean(pg_losses * seq_w)


def test_gmpo_correction_weight_is_the_geometric_mean():
    """Issue 49's case: w = [2, 0.5], ratio 1, A = 1: verl −1.00 (the arithmetic mean gave −1.25)."""
    mb = SimpleNamespace(
        loss_mask=torch.ones(1, 2),
        extras=BatchExtras(
            old_logp=torch.zeros(1, 2),
            advantages=torch.ones(1, 2),
            is_weight=torch.tensor([[2.0, 0.5]]),
        ),
    )
    c = cfg(policy_loss="gmpo", clip_low=0.4, clip_high=0.4)
    loss, _ = batch_policy_loss(c, torch.zeros(1, 2), mb)
    assert float(seq_mean_token_mean(loss, mb.loss_mask)) == pytest.approx(-1.0, abs=1e-6)
    for seed in range(5):
        mask, old, logp0, rewards = rand_inputs(seed)
        adv = (rewards - rewards.mean())[:, None] * mask
        w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) * 2 * mask
        mb = SimpleNamespace(loss_mask=mask, extras=BatchExtras(old_logp=old, advantages=adv, is_weight=w))
        v, g = value_and_grad(lambda lp: seq_mean_token_mean(batch_policy_loss(c, lp, mb)[0], mask), logp0)
        rv, rg = value_and_grad(lambda lp: verl_geo_mean_weighted(lp, old, adv, mask, 0.4, w), logp0)
        assert v == pytest.approx(rv, rel=1e-5, abs=1e-6) and torch.allclose(g, rg, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- SAPO


def test_sapo_equals_trl_and_verl_on_random_inputs():
    """Values and gradients within 1e-6 of TRL's loss_type sapo (and verl's), default and other τ."""
    for seed in range(8):
        mask, old, logp0, _ = rand_inputs(seed)
        adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(100 + seed)) * mask
        for taus in ((1.0, 1.05), (0.5, 2.0)):
            c = cfg(policy_loss_args={"tau_pos": taus[0], "tau_neg": taus[1]})
            v, g = value_and_grad(lambda lp: ours(sapo, lp, old, adv, mask, c), logp0)
            tv, tg = value_and_grad(lambda lp: trl_sapo(lp, old, adv, mask, *taus), logp0)
            vv, vg = value_and_grad(lambda lp: verl_sapo(old, lp, adv, mask, *taus), logp0)
            assert abs(v - tv) < 1e-6 and (g - tg).abs().max() < 1e-6
            assert abs(v - vv) < 1e-6 and (g - vg).abs().max() < 1e-6


def test_sapo_hand_computed():
    """At ρ = 1 the gate is σ(0)·4/τ = 2/τ and its gradient A·∇log π (the policy gradient); ρ = e: A = 1,
    τ = 1: −4σ(e − 1) = −3.3178."""
    old = torch.zeros(1, 2)
    logp0 = torch.tensor([[0.0, 1.0]])
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    logp = logp0.clone().requires_grad_(True)
    loss, m = sapo(logp, old, adv, mask, cfg())
    loss.sum().backward()
    assert loss.tolist()[0] == pytest.approx([-2.0, -4 / (1 + math.exp(-(math.e - 1)))], rel=1e-6)
    s = 1 / (1 + math.exp(-(math.e - 1)))
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, -4 * s * (1 - s) * math.e], rel=1e-6)
    assert float(m["clip_frac"].sum()) == 0.0


def test_a_stale_token_gives_sapo_a_finite_gradient():
    logp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    loss, _ = sapo(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), cfg())
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "gmpo", "sapo"])
@pytest.mark.parametrize("Config", [GRPOConfig, PPOConfig])
def test_per_sequence_losses_refuse_token_mean(Config, loss):
    """Issue 49's case for gspo_token: rows of 4 and 1 tokens, log ρ 0.1, A = ±1 give −0.663 under token-mean
    where verl's per-sequence mean gives 0: refused, with the fix in the message."""
    with pytest.raises(ValueError, match="loss_agg: seq-mean-token-mean"):
        Config(policy_loss=loss, loss_agg="token-mean")
    Config(policy_loss=loss, loss_agg="seq-mean-token-mean")


def test_gspo_token_under_token_mean_would_weight_by_length():
    """Why token-mean is refused: the issue's numbers."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    old = torch.zeros(2, 4)
    logp = torch.full((2, 4), 0.1) * mask
    adv = torch.tensor([[1.0], [-1.0]]) * mask
    loss, _ = gspo_token(logp, old, adv, mask, cfg())
    token_mean = float((loss * mask).sum() / mask.sum())
    assert token_mean == pytest.approx(-0.663, abs=1e-3)
    assert float(seq_mean_token_mean(loss, mask)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "cispo", "gmpo", "sapo"])
def test_dual_clip_is_refused_where_it_does_nothing(loss):
    with pytest.raises(ValueError, match="dual_clip"):
        GRPOConfig(policy_loss=loss, loss_agg="seq-mean-token-mean", dual_clip=3.0)
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(policy_loss=loss, loss_agg="seq-mean-token-mean", dual_clip=3.0)
    GRPOConfig(policy_loss="clip", dual_clip=3.0)


def test_sapo_temperatures_must_be_positive():
    """SAPO's temperatures are its declared arguments (policy_loss_args), checked against their ranges."""
    with pytest.raises(
        ValueError, match="policy_loss_args.tau_neg of policy_loss 'sapo' must be greater than 0"
    ):
        GRPOConfig(policy_loss="sapo", loss_agg="seq-mean-token-mean", policy_loss_args={"tau_neg": 0.0})
    with pytest.raises(ValueError, match=r"takes no such argument \(its arguments: tau_pos, tau_neg\)"):
        GRPOConfig(policy_loss="sapo", loss_agg="seq-mean-token-mean", policy_loss_args={"tau": 1.0})
    with pytest.raises(ValueError, match="its arguments: none"):
        GRPOConfig(policy_loss="clip", policy_loss_args={"tau_pos": 1.0})
    c = GRPOConfig(policy_loss="sapo", loss_agg="seq-mean-token-mean", policy_loss_args={"tau_neg": 2})
    from searchrl.algorithms.objective import arguments

    assert arguments(c, "sapo") == {"tau_pos": 1.0, "tau_neg": 2.0}  # the declared default fills the rest
    assert replace(c, policy_loss="clip", loss_agg="token-mean", policy_loss_args={}).policy_loss == "clip"


# ------------------------------------------------------------------------------------------- DAPO


def traj(reward, answer, gold="Paris"):
    return SimpleNamespace(reward=reward, answer=answer, example=SimpleNamespace(answers=[gold]))


def test_a_group_of_one_is_kept_as_verl_keeps_it():
    assert informative([traj(1.0, "Paris")]) and informative([traj(0.0, "x")], "correct")


def test_the_correct_answer_criterion():
    """Shaped rewards differ while every answer is wrong: kept by reward, dropped by DAPO's eq. 11."""
    all_wrong = [traj(0.1, "Rome"), traj(0.3, "Lyon")]
    mixed = [traj(1.0, "Paris"), traj(1.0, "Rome")]
    assert informative(all_wrong) and not informative(all_wrong, "correct")
    assert not informative(mixed) and informative(mixed, "correct")
    with pytest.raises(ValueError, match="criterion"):
        DynamicSampling(criterion="f1")


def test_dynamic_sampling_with_groups_of_one_trains(make_exp, tmp_path):
    """GRPO with reinforce_pp, group_size 1 and dynamic sampling: every group kept, nothing resampled."""
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    exp = make_exp("rollout.temperature=1.0")
    cfg_ = TrainerConfig(steps=1, batch_size=4, micro_batch_size=8, lr=1e-3, save_every=10**6)
    args = {"group_size": 1, "advantage": "reinforce_pp", "dynamic_sampling": {"enabled": True}}
    tr = trainer_for(exp, "grpo", cfg_, args=args, out=tmp_path / "g1")
    tr.run()
    (row,) = read_metrics(tmp_path / "g1" / "metrics.jsonl")
    assert row["dapo/groups_dropped"] == 0 and row["dapo/attempts"] == 1


# ------------------------------------------------------------------------------------------- normalisers


def verl_agg(loss, mask, mode, norm_len=None):
    """verl agg_loss on one process over the whole batch."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    seq_n = mask.sum(-1)
    keep = (seq_n > 0).float()
    if mode == "seq-mean-token-mean":
        return (((loss * mask).sum(-1) / (seq_n + 1e-8)) * keep).sum() / keep.sum()
    if mode == "seq-mean-token-sum":
        return ((loss * mask).sum(-1) * keep).sum() / keep.sum()
    return (loss * mask).sum() / (keep.sum() * norm_len)  # Dr. GRPO's constant (our token-sum-norm)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"]
)
def test_normalisation_over_micro_batches_and_processes_equals_one_batch(mode):
    """The loss summed over 2 processes × 3 micro-batches, each weighted with the global counts (what the
    trainer does), equals verl's aggregate of the whole batch: values and gradients."""
    g = torch.Generator().manual_seed(3)
    B, T = 12, 7
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # an empty row too, sometimes
    lengths[0] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    x0 = torch.randn(B, T, generator=g)
    norm_len = 10.0
    xa = x0.clone().requires_grad_(True)
    ref = verl_agg(xa**2, mask, mode, norm_len)
    ref.backward()
    g_tokens, g_seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    xb = x0.clone().requires_grad_(True)
    total = torch.zeros(())
    for proc in (range(0, 6), range(6, 12)):
        rows = list(proc)
        for mb in (rows[:2], rows[2:3], rows[3:]):
            w = token_weights(mask[mb], mode, g_tokens, g_seqs, norm_len)
            total = total + (xb[mb] ** 2 * w).sum()
    total.backward()
    assert float(total) == pytest.approx(float(ref), rel=1e-6)
    assert torch.allclose(xb.grad, xa.grad, atol=1e-7)


def test_dropping_rejected_tokens_is_verls_normaliser():
    """rejected: drop normalises over the kept tokens, as verl (which removes them from the response mask);
    keep normalises over all, so with seq-mean-token-mean a row with half its tokens rejected gets half of
    verl's gradient and the direction differs (the corrected claim of `algorithms.correction`)."""
    mask = torch.ones(2, 4)
    kept = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    grads = {}
    for how, norm in (("keep", mask), ("drop", mask * kept), ("verl", kept)):
        x = torch.ones(2, 4, requires_grad=True)
        w = token_weights(norm, "seq-mean-token-mean", float(norm.sum()), float((norm.sum(-1) > 0).sum()))
        (x * kept * w).sum().backward()  # the loss of a rejected token is 0 (w_t = 0)
        grads[how] = x.grad
    assert torch.equal(grads["drop"], grads["verl"])
    assert (
        grads["keep"][0, 0] == pytest.approx(0.5 * grads["verl"][0, 0])
        and grads["keep"][1, 0] == grads["verl"][1, 0]
    )
    cos = torch.nn.functional.cosine_similarity(grads["keep"].flatten(), grads["verl"].flatten(), dim=0)
    assert float(cos) < 0.99


def test_rejected_drop_is_validated_and_forces_the_old_pass(make_exp, tmp_path):
    from searchrl.algorithms.correction import RolloutCorrection
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    with pytest.raises(ValueError, match="mask modes"):
        RolloutCorrection(mode="token_tis", rejected="drop")
    with pytest.raises(ValueError, match="'keep' or 'drop'"):
        RolloutCorrection(mode="token_mask", rejected="sometimes")
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    cfg_ = TrainerConfig(steps=1, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=10**6)
    # a band so narrow that the sampler's and the trainer's rounding differences reject some tokens
    corr = {"mode": "token_mask", "high": 1.0 + 1e-7, "low": 1.0 - 1e-7, "rejected": "drop"}
    tr = trainer_for(exp, "grpo", cfg_, args={"rollout_correction": corr, "kl_coef": 0.0}, out=tmp_path / "d")
    assert tr.training_step.shape.old_pass
    tr.run()
    (row,) = read_metrics(tmp_path / "d" / "metrics.jsonl")
    assert math.isfinite(row["train/loss"]) and 0.0 <= row["rollout_corr/cut_token_frac"] <= 1.0


def test_the_sampler_and_the_trainer_use_the_same_temperature(make_exp, tmp_path):
    """At rollout.temperature 0.5 the sampled log-probs equal the trainer's recomputed ones (a trainer at
    another temperature would differ by far more than 1e-4)."""
    from searchrl.core.config import TrainerConfig
    from searchrl.engine.metrics import read_metrics
    from tests.engine.test_trainer import trainer_for

    exp = make_exp("rollout.temperature=0.5")
    cfg_ = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=1e-3, save_every=10**6)
    tr = trainer_for(exp, "grpo", cfg_, out=tmp_path / "t")
    assert tr.training_step.shape.temperature == 0.5
    tr.run()
    (row,) = read_metrics(tmp_path / "t" / "metrics.jsonl")
    assert row["rollout/logprob_max_diff"] < 1e-4
