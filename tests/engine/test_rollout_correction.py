"""The sampler-trainer correction inside a training step: a sampler whose log-probs are off by a known amount
gives the hand-computed diagnostics, weights and losses; mode none is the papers' objective."""

import math

import pytest
import torch

from searchrl.core.config import TrainerConfig
from tests.engine.test_trainer import state, trainer_for

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics

SHIFT = 0.1  # the sampler reports log μ = log π + 0.1 on every action token: log ρ = −0.1


def shifted(tr, shift=SHIFT):
    """Every collected action token's recorded log-prob moved by ``shift`` (a sampler that disagrees)."""
    collect = tr.algo.collect

    def noisy(indices):
        trajs, metrics = collect(indices)
        for t in trajs:
            for seg in t.segments:
                if seg.kind == "action" and seg.logprobs is not None:
                    seg.logprobs = [x + shift for x in seg.logprobs]
        return trajs, metrics

    tr.algo.collect = noisy
    return tr


def one_step(exp, tmp_path, name, correction, algorithm="grpo", args=None, **cfg_kw):
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=8, lr=5e-3, save_every=10**6, **cfg_kw)
    args = {"kl_coef": 0.0, **(args or {}), "rollout_correction": correction}
    tr = shifted(trainer_for(exp, algorithm, cfg, args=args, out=tmp_path / name))
    torch.manual_seed(0)
    before = state(tr.policy)
    metrics = tr.step(0)
    return tr, metrics, before, state(tr.policy)


@pytest.fixture
def exp(make_exp):
    return make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")


def test_a_shifted_sampler_gives_the_hand_computed_diagnostics_and_weights(exp, tmp_path):
    _, none, b0, a0 = one_step(exp, tmp_path, "none", {"mode": "none"})
    k3 = math.exp(-SHIFT) + SHIFT - 1  # ρ − log ρ − 1 at log ρ = −0.1
    assert none["rollout_corr/k3_kl"] == pytest.approx(k3, rel=1e-2)
    assert none["rollout/logprob_abs_diff"] == pytest.approx(SHIFT, abs=1e-4)
    assert none["rollout_corr/w_mean"] == 1.0 and none["rollout_corr/ess"] == pytest.approx(1.0)
    assert none["rollout_corr/cut_token_frac"] == 0.0

    _, tis, _, a1 = one_step(exp, tmp_path, "tis", {"mode": "token_tis"})
    assert tis["rollout/tokens_generated"] == none["rollout/tokens_generated"]  # the same episodes
    assert tis["rollout_corr/w_mean"] == pytest.approx(math.exp(-SHIFT), rel=1e-3)  # under the clip 2
    assert tis["rollout_corr/ess"] == pytest.approx(1.0, abs=1e-4)  # equal weights lose nothing
    # with no KL term the loss is the policy loss alone, weighted by e^−0.1 on every token
    assert tis["train/loss"] == pytest.approx(math.exp(-SHIFT) * none["train/loss"], rel=1e-3, abs=1e-7)
    assert any(not torch.equal(b0[k], a1[k]) for k in b0) and any(not torch.equal(b0[k], a0[k]) for k in b0)

    # a mask that keeps ratios within [1/1.05, 1.05] rejects every token (ρ = 0.905): nothing trains
    _, rej, b2, a2 = one_step(exp, tmp_path, "rej", {"mode": "token_mask", "high": 1.05})
    assert rej["rollout_corr/cut_token_frac"] == 1.0 and rej["rollout_corr/cut_seq_frac"] == 1.0
    assert rej["rollout_corr/w_mean"] == 0.0 and rej["train/loss"] == 0.0 and rej["train/grad_norm"] == 0.0
    assert all(torch.equal(b2[k], a2[k]) for k in b2)  # no weight decay: the policy did not move
    _, geo, _, _ = one_step(exp, tmp_path, "geo", {"mode": "geo_mask", "high": 1.2})
    assert geo["rollout_corr/cut_seq_frac"] == 0.0 and geo["train/loss"] == pytest.approx(none["train/loss"])


def test_the_decoupled_objective_with_a_separate_pi_old_pass(exp, tmp_path):
    """Two updates per batch: π_old is recomputed before the updates, the weights come from that pass and
    stay fixed while π_θ moves (the clip is against π_old, the weight against the sampler)."""
    tr, m, _, _ = one_step(exp, tmp_path, "two", {"mode": "seq_tis", "clip": 1.5}, mini_batches=2)
    assert tr.training_step.shape.old_pass
    assert m["rollout_corr/w_mean"] < 1.0 and m["rollout_corr/cut_token_frac"] == 0.0  # Π ρ < 1 < 1.5


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_kl_term_and_its_logged_estimate_carry_the_correction_weight(exp, tmp_path, algorithm):
    """A KL term in the loss and two updates per batch (the first starts at the reference, where the KL
    estimate and its gradient are 0 up to the rounding between the two models' passes): the logged
    ``train/kl`` is the weighted estimate, e^−0.1 · ``train/kl_unweighted`` (w is e^−0.1 on every token);
    with ``weight_kl: false`` it is the plain estimate after nearly the same first update, and no other is
    logged.

    The estimator is k3 for both algorithms (PPO's default is k1): k3 = ρ − log ρ − 1 is ≥ 0 on every token and
    > 0 where the policy has moved, so the sign below holds by construction. k1 (log ρ) of a policy that moved
    a little has the sign float rounding gives it (−0.0118 on one CPU, positive on another)."""
    args = {"kl_coef": 0.05, "kl_in": "loss", "kl_estimator": "k3"}
    corr = {"mode": "token_tis"}
    _, m, _, _ = one_step(exp, tmp_path, "w", corr, algorithm, mini_batches=2, args=args)
    assert m["train/kl_unweighted"] > 1e-7  # the second update's policy has left the reference
    assert m["train/kl"] == pytest.approx(math.exp(-SHIFT) * m["train/kl_unweighted"], rel=1e-4)
    if (
        algorithm == "ppo"
    ):  # the estimate PPO logs (and its adaptive β follows) before the updates: π_old = π_ref
        assert m["kl/sequence"] == 0.0
    _, plain, _, _ = one_step(
        exp, tmp_path, "p", {**corr, "weight_kl": False}, algorithm, mini_batches=2, args=args
    )
    assert "train/kl_unweighted" not in plain
    assert plain["train/kl"] == pytest.approx(m["train/kl_unweighted"], rel=0.05)


def test_ppo_takes_the_correction_on_its_policy_loss_only(exp, tmp_path):
    _, none, _, _ = one_step(exp, tmp_path, "ppo0", {"mode": "none"}, algorithm="ppo")
    _, rej, _, _ = one_step(exp, tmp_path, "ppo1", {"mode": "token_mask", "high": 1.05}, algorithm="ppo")
    assert rej["rollout_corr/cut_token_frac"] == 1.0
    assert rej["train/pg_loss"] == 0.0 and rej["train/value_loss"] == pytest.approx(none["train/value_loss"])


def test_offline_algorithms_refuse_the_key(exp):
    from searchrl.algorithms.sft import SFTConfig
    from searchrl.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="rollout_correction"):
        from_dict(SFTConfig, {"rollout_correction": {"mode": "token_tis"}}, key="algorithm")
