"""AEPO (arXiv 2510.14545): each part against hand-computed values and against references written from the released
code (``dongguanting/ARPO``, ``AEPO/``: ``vllm_rollout_with_tools.py`` and ``core_algos.py``): the pre-monitored
budget, the consecutive-branch penalty, the entropy-aware advantage and the entropy-balanced clipped loss (values
and gradients); a scripted collection whose budget follows the probe's entropies; a trained step on the tiny
agent; and the configurations `validate` refuses."""

from __future__ import annotations

import math
import random

import pytest
import torch

from searchrl.algorithms.aepo import (
    AEPOConfig,
    entropy_weighted,
    penalized_branch_taken,
    premonitored_rollouts,
    streak,
)
from searchrl.algorithms.loss_terms import clipped_policy_loss
from searchrl.core.config import TrainerConfig
from searchrl.core.errors import ConfigError
from searchrl.rollout.generator import SamplingParams
from tests.algorithms.test_arpo import Scripted
from tests.engine.test_trainer import trainer_for


def released_initial_rollouts(initial_entropy, step_entropies, num_samples):
    """``_calculate_initial_rollouts_dynamical``'s step 3, as released: the mean step entropy (the initial one
    when there is none), sigmoid(0.5 · difference), int(n · σ) + 1 within [1, n]."""
    avg = sum(step_entropies) / len(step_entropies) if step_entropies else initial_entropy
    sigmoid_value = 1 / (1 + math.exp(-(0.5 * (initial_entropy - avg))))
    initial_rollouts = int(num_samples * sigmoid_value) + 1
    return max(1, min(initial_rollouts, num_samples))


def released_branch(u, entropy_delta, consecutive, tau, weight):
    """The released branching lines: prob = random() + w·ΔH; prob *= max(0, 1 − 0.05·l); clipped to [0, 1];
    ``if prob < branch_probability: continue``."""
    prob = u + weight * entropy_delta
    prob = prob * max(0.0, 1.0 - 0.05 * consecutive)
    prob = max(0.0, min(1.0, prob))
    return not prob < tau


def released_entropy_advantage(advantages, entropy, response_mask):
    """``compute_policy_loss_entropy_balanced_clipping``'s advantage lines, as released."""
    valid = (entropy * response_mask.float())[response_mask.bool()]
    if len(valid) > 0:
        mean, std = valid.mean(), valid.std()
        if std == 0:
            std = 1.0
        advantages = advantages * (1 + 0.2 * ((entropy - mean) / std).detach())
    return advantages


def released_loss(old_log_prob, log_prob, advantages, low, high, clip_ratio_c=3.0):
    """The released surrogate with ``enable_entropy_balanced_clipping``, per token (before aggregation)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    min_bound = torch.full_like(ratio, 1 - low)
    max_bound = (1 + high) / ratio.detach() * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, min_bound, max_bound)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def test_premonitored_budget_hand_computed_and_as_released():
    # M 8, β 0.5: σ(0.5·0.2) = 0.52498 → ⌊4.1998⌋ + 1 = 5; equal entropies: ⌊4⌋ + 1 = 5
    assert premonitored_rollouts(0.3, 0.1, 8, 0.5) == 5
    assert premonitored_rollouts(0.2, 0.2, 8, 0.5) == 5
    assert premonitored_rollouts(0.0, 4.0, 8, 0.5) == 1  # σ(−2) = 0.119 → ⌊0.95⌋ + 1 = 1
    assert premonitored_rollouts(100.0, 0.0, 8, 0.5) == 8  # σ → 1: ⌊8⌋ + 1 = 9, held to M
    assert premonitored_rollouts(0.0, 100.0, 8, 0.5) == 1
    rng = random.Random(0)
    for _ in range(2000):
        h0, n = rng.uniform(0, 3), rng.randint(1, 16)
        steps = [rng.uniform(0, 3) for _ in range(rng.randint(1, 5))]
        mine = premonitored_rollouts(h0, sum(steps) / len(steps), n, 0.5)
        assert mine == released_initial_rollouts(h0, steps, n)


def test_branch_penalty_hand_computed_and_as_released():
    assert penalized_branch_taken(0.45, 0.5, 0.5, 0.2, 0, 0.05)  # 0.45 + 0.1 = 0.55 ≥ 0.5
    assert not penalized_branch_taken(0.45, 0.5, 0.5, 0.2, 2, 0.05)  # 0.55 · 0.9 = 0.495 < 0.5
    assert penalized_branch_taken(0.9, 0.0, 0.5, 0.2, 4, 0.05)  # 0.9 · 0.8 = 0.72
    assert not penalized_branch_taken(0.99, 5.0, 0.5, 0.2, 20, 0.05)  # the factor reaches 0
    rng = random.Random(1)
    for _ in range(3000):
        u, d, tau, w, n = (
            rng.random(),
            rng.uniform(-3, 3),
            rng.random(),
            rng.uniform(0, 1),
            rng.randint(0, 25),
        )
        assert penalized_branch_taken(u, d, tau, w, n, 0.05) == released_branch(u, d, n, tau, w)
    # over u ~ U(0, 1), with no streak the probability is ARPO's clip(τ + β·ΔH) at τ = 0.5 …
    draws = [penalized_branch_taken(rng.random(), 1.0, 0.5, 0.2, 0, 0.05) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(0.7, abs=0.02)
    # … and each consecutive branching round lowers it: P((u + 0.2)·0.8 ≥ 0.5) = P(u ≥ 0.425) = 0.575
    draws = [penalized_branch_taken(rng.random(), 1.0, 0.5, 0.2, 4, 0.05) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(0.575, abs=0.02)


def test_streak_counts_the_tool_calls_just_before():
    branched = {(0, 0), (0, 1), (0, 3), (1, 2)}
    assert [streak(branched, 0, s) for s in range(6)] == [0, 1, 2, 0, 1, 0]
    assert [streak(branched, 1, s) for s in range(5)] == [0, 0, 0, 1, 0]
    assert streak(set(), 0, 7) == 0


def test_entropy_aware_advantage_hand_computed_and_as_released():
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0, 9.0], [2.0, 2.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # action-token entropies 1, 2, 3, 2, 2: mean 2, unbiased std √(2/4) = 0.7071
    out, z = entropy_weighted(adv, ent, mask, 0.2)
    s = math.sqrt(0.5)
    want = [1 - 0.2 / s, 1.0, 1 + 0.2 / s, 0.0, -2.0, -2.0, 0.0, 0.0]
    assert out.flatten().tolist() == pytest.approx(want, abs=1e-6)
    assert z[0, 3] == 0 and z[1, 2] == 0  # off the mask
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.randn(4, 9, generator=gen)
        h = torch.rand(4, 9, generator=gen) * 3
        m = (torch.rand(4, 9, generator=gen) > 0.3).float()
        ref = released_entropy_advantage(a, h, m) * m
        mine, _ = entropy_weighted(a, h, m, 0.2)
        assert torch.allclose(mine * m, ref, atol=1e-6)
    flat, _ = entropy_weighted(adv, torch.ones_like(ent), mask, 0.2)  # std 0 → 1: nothing changes
    assert torch.equal(flat, adv)


def test_entropy_balanced_loss_keeps_the_upper_clip_gradient():
    """ρ = e^0.5 = 1.649 > 1 + ε: with A = 1 the clip's gradient is 0, AEPO's −(1 + ε_high) = −1.2 (d loss /
    d log π); with A = −1 both are the unclipped ρ; ρ = e^−0.5 < 1 − ε with A = −1: both 0. Values equal the
    clip's everywhere."""
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    grads = {}
    for keep in (False, True):
        logp = torch.tensor([[0.5, 0.5, -0.5, 0.05]], requires_grad=True)
        loss, m = clipped_policy_loss(logp, old, adv, 0.2, 0.2, keep_high_gradient=keep)
        loss.sum().backward()
        grads[keep] = (loss.detach(), logp.grad.clone(), m["clip_frac"])
    (v0, g0, c0), (v1, g1, c1) = grads[False], grads[True]
    assert torch.allclose(v0, v1) and torch.equal(c0, c1)
    rho, rho_small = math.exp(0.5), math.exp(0.05)
    assert g0.tolist()[0] == pytest.approx([0.0, rho, 0.0, -rho_small], abs=1e-6)
    assert g1.tolist()[0] == pytest.approx([-1.2, rho, 0.0, -rho_small], abs=1e-6)


def test_entropy_balanced_loss_equals_the_released_values_and_gradients():
    """Against the released surrogate (dual clip c = 3) on random ratios, both advantage signs."""
    from searchrl.algorithms.policy_losses import entropy_balanced

    gen = torch.Generator().manual_seed(2)
    cfg = AEPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    for _ in range(10):
        old = torch.randn(3, 11, generator=gen)
        adv = torch.randn(3, 11, generator=gen)
        base = old + torch.randn(3, 11, generator=gen) * 0.6
        a = base.clone().requires_grad_(True)
        b = base.clone().requires_grad_(True)
        mine, _ = entropy_balanced(a, old, adv, torch.ones_like(adv), cfg)
        ref = released_loss(old, b, adv, 0.2, 0.28, 3.0)
        assert torch.allclose(mine, ref, atol=1e-6)
        mine.sum().backward()
        ref.sum().backward()
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_config_is_checked(make_exp):
    from searchrl.app.experiment import check_arguments

    assert AEPOConfig().policy_loss == "entropy_balanced" and AEPOConfig().dynamic_rollouts
    with pytest.raises(ValueError, match="entropy_advantage"):
        AEPOConfig(entropy_advantage=-0.1)
    with pytest.raises(ValueError, match="initial_rollouts"):
        AEPOConfig(group_size=4, initial_rollouts=5)
    exp = check_arguments(make_exp("algorithm={name: aepo, group_size: 4, initial_rollouts: 2}"))
    assert exp.algorithm.settings.branch_penalty == 0.05
    with pytest.raises(ConfigError, match="rollout.compile"):
        check_arguments(make_exp("algorithm={name: aepo}", "rollout.compile=true"))
    with pytest.raises(ConfigError, match="max_staleness"):
        check_arguments(make_exp("algorithm={name: aepo}", "trainer.async_rollout.max_staleness=1"))


@pytest.mark.parametrize(
    ("first", "later", "m", "branches", "calls"),
    [(5.0, 0.1, 4, 0, 2 + 4 * 2), (0.1, 5.0, 1, 1, 2 + 2 + 1 + 2 * 2)],
)
def test_probe_entropies_set_the_budget(
    tiny_model_dir, world_bm25, small_world, first, later, m, branches, calls
):
    """The probe chain searches, reads, answers; β_pre large: a root more uncertain than the mean step gets all
    M = 4 rows as whole chains (no branch budget); a less uncertain one a single chain and a budget of 3, of which
    the one observation branches once (τ 1, β large: exactly when the entropy rose) and fresh chains fill 2.
    Generations: the probe's two turns, then each chain's two, a branch's one (its answer)."""
    from searchrl.algorithms.aepo import AEPO
    from searchrl.algorithms.base import Context
    from searchrl.envs.search import SearchEnv
    from searchrl.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(tiny_model_dir)
    env = SearchEnv(world_bm25, template="short", topk=2, max_turns=3)
    cfg = AEPOConfig(
        group_size=4, initial_rollouts=2, branch_probability=1.0, entropy_weight=1e6, premonitor_beta=1e6
    )
    gen = Scripted(tok, first, later)
    ctx = Context(
        env, gen, tok, lambda trajs: {}, SamplingParams(1.0, 1.0, 16), 512, small_world.examples("train")[:1]
    )
    rows, metrics = AEPO(cfg, ctx).collect([0])
    assert len(rows) == 4 and float(metrics["aepo/initial_rollouts"]) == m
    assert metrics["arpo/branches"] == branches and metrics["arpo/fresh_rows"] == 4 - m - branches
    assert float(metrics["aepo/probe_tokens"]) > 0 and gen.calls == calls
    assert all(t.state.done and t.episode.answer == "x" for t in rows)


def test_aepo_trains_with_entropy_logging_off(make_exp, agent_model_dir, tmp_path):
    """A collected and trained step on the tiny agent: M rows per question, the entropy computed for the
    advantage although ``trainer.log_entropy`` is off, a finite loss, parameters moved."""
    exp = make_exp(
        f"model.path={agent_model_dir}",
        "env.template=short",
        "env.topk=2",
        "env.max_turns=3",
        "rollout.temperature=1.0",
        "rewards=[{name: test_trainer_length}]",
    )
    cfg = TrainerConfig(
        steps=1, batch_size=2, micro_batch_size=8, lr=5e-3, save_every=10**6, log_entropy=False
    )
    args = {"kl_coef": 0.0, "group_size": 4, "initial_rollouts": 2, "entropy_tokens": 3}
    tr = trainer_for(exp, "aepo", cfg, args=args, out=tmp_path / "run")
    assert tr.algo.requires(tr.algo.cfg, exp.env).entropy
    before = {k: v.detach().clone() for k, v in tr.policy.named_parameters()}
    m = tr.step(0)
    assert math.isfinite(m["train/loss"])
    assert 1 <= m["aepo/initial_rollouts"] <= 4 and m["arpo/branches"] + m["arpo/fresh_rows"] >= 0
    assert "train/aepo/entropy_z_abs" in m and "train/entropy" in m
    assert any(not torch.equal(before[k], v) for k, v in tr.policy.named_parameters())
