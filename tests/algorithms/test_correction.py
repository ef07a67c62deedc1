"""Rollout correction: each mode against a hand-computed case and against a loop-by-loop reference written
from verl's rollout_corr formulas (docs/algo/rollout_corr_math.md §3.3-3.4, §4.1) on random inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms.correction import MODES, RolloutCorrection, correction_weights, effective_sample_size
from searchrl.core.config import ConfigError, from_dict
from searchrl.core.types import BatchExtras

# two sequences; log ρ = old − behaviour. Row 0: ρ = (e^1, 1, e^−0.5) on 3 tokens; row 1: ρ = (e^0.1, e^0.1)
OLD = torch.tensor([[0.0, -1.0, -2.0, -1.5, 0.0], [0.0, -0.4, -0.6, 0.0, 0.0]])
BEH = torch.tensor([[0.0, -2.0, -2.0, -1.0, 0.0], [0.0, -0.5, -0.7, 0.0, 0.0]])
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
E = math.e


def weights(mode, **kw):
    w, _ = correction_weights(OLD, BEH, MASK, RolloutCorrection(mode=mode, **kw))
    return w


def test_hand_computed_weights_of_every_mode():
    e01 = math.exp(0.1)
    cases = {
        "none": [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]],
        "token_tis": [[0, 2.0, 1, math.exp(-0.5), 0], [0, e01, e01, 0, 0]],  # min(ρ, 2)
        # ρ in [0.5, 2]: e (2.72) out, e^-0.5 (0.61) in
        "token_mask": [[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]],
        # Π ρ: row 0 e^0.5 = 1.65, row 1 e^0.2 = 1.22, both under 2
        "seq_tis": [
            [0, math.exp(0.5)] * 1 + [math.exp(0.5)] * 2 + [0],
            [0, math.exp(0.2), math.exp(0.2), 0, 0],
        ],
        "seq_mask": [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]],
        # geometric mean: row 0 e^(0.5/3) = 1.18 out of [1/1.01, 1.01]; row 1 e^0.1 = 1.105 out too
        "geo_mask": [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]],
    }
    for mode, want in cases.items():
        torch.testing.assert_close(weights(mode), torch.tensor(want, dtype=torch.float), msg=mode)
    assert weights("seq_tis", clip=1.5)[0, 1] == pytest.approx(1.5)  # e^0.5 truncated
    assert weights("seq_mask", high=1.5)[0].tolist() == [0, 0, 0, 0, 0]  # e^0.5 > 1.5: the whole row
    assert weights("geo_mask", high=1.2).tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]]
    assert weights("token_mask", high=3.0, low=0.7)[0].tolist() == [0, 1, 1, 0, 0]


def test_diagnostics_hand_computed():
    _, s = correction_weights(OLD, BEH, MASK, RolloutCorrection(mode="token_tis"))
    k3 = lambda lr: math.exp(lr) - lr - 1  # noqa: E731
    assert s["tokens"].tolist() == [3, 2]
    assert s["k3_kl"].tolist() == pytest.approx([k3(1) + k3(0) + k3(-0.5), 2 * k3(0.1)], rel=1e-5)
    assert s["log_ratio"].tolist() == pytest.approx([0.5, 0.2], rel=1e-5)
    assert s["cut_tokens"].tolist() == [1, 0] and s["cut_seq"].tolist() == [1, 0]
    w = [2.0, 1.0, math.exp(-0.5), math.exp(0.1), math.exp(0.1)]
    assert float(s["w_sum"].sum()) == pytest.approx(sum(w), rel=1e-5)
    assert float(s["w_sq_sum"].sum()) == pytest.approx(sum(x * x for x in w), rel=1e-5)
    assert effective_sample_size(sum(w), sum(x * x for x in w), 5) == pytest.approx(
        sum(w) ** 2 / (5 * sum(x * x for x in w))
    )
    assert effective_sample_size(5.0, 5.0, 5) == 1.0  # equal weights


def reference(old, beh, mask, mode, clip, low, high):
    """verl's definitions, one token at a time in plain Python."""
    out = []
    for o_row, b_row, m_row in zip(old.tolist(), beh.tolist(), mask.tolist()):
        lr = [o - b for o, b, m in zip(o_row, b_row, m_row) if m]
        if mode == "none":
            ws = [1.0] * len(lr)
        elif mode == "token_tis":
            ws = [min(math.exp(x), clip) for x in lr]
        elif mode == "token_mask":
            ws = [1.0 if low <= math.exp(x) <= high else 0.0 for x in lr]
        elif mode == "seq_tis":
            ws = [min(math.exp(sum(lr)), clip)] * len(lr)
        elif mode == "seq_mask":
            ws = [1.0 if low <= math.exp(sum(lr)) <= high else 0.0] * len(lr)
        else:
            g = math.exp(sum(lr) / len(lr)) if lr else 1.0
            ws = [1.0 if low <= g <= high else 0.0] * len(lr)
        it = iter(ws)
        out.append([next(it) if m else 0.0 for m in m_row])
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(MODES),
    scale=st.sampled_from([0.01, 0.1, 0.5]),
    high=st.sampled_from([None, 1.001, 1.5, 3.0]),
)
def test_every_mode_matches_the_reference_on_random_inputs(seed, mode, scale, high):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    beh = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = beh + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    mask = (torch.rand(B, T, generator=g) < 0.7).double()
    mask[0] = 0.0  # a row without action tokens
    cfg = RolloutCorrection(mode=mode, high=high)
    hi, lo = cfg.bounds()
    w, s = correction_weights(old, beh, mask, cfg)
    want = torch.tensor(reference(old, beh, mask, mode, cfg.clip, lo, hi), dtype=torch.float64)
    torch.testing.assert_close(w, want, rtol=1e-9, atol=1e-12)
    assert float(s["tokens"][0]) == 0 and float(s["w_sum"][0]) == 0 and float(s["k3_kl"][0]) == 0
    assert bool((s["k3_kl"] >= -1e-12).all())  # ρ − log ρ − 1 ≥ 0
    assert bool(((w >= 0) & (w <= max(cfg.clip, 1.0))).all())
    assert bool((w[mask == 0] == 0).all())


def test_the_weight_multiplies_the_clipped_loss_as_a_constant():
    """`batch_policy_loss` applies the micro-batch's ``is_weight`` to whichever policy loss is configured."""
    from types import SimpleNamespace

    from searchrl.algorithms.policy_losses import batch_policy_loss

    old = torch.tensor([[-1.1, -0.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    w = weights("token_tis")[0, 1:4][None]  # (2, 1, e^-0.5)
    cfg = SimpleNamespace(policy_loss="clip", clip_low=0.2, clip_high=0.2, dual_clip=None)
    grads = []
    for weight in (None, w):
        logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
        extras = BatchExtras(old_logp=old, advantages=adv, is_weight=weight)
        loss, _ = batch_policy_loss(cfg, logp, SimpleNamespace(extras=extras, loss_mask=torch.ones(1, 3)))
        loss.sum().backward()
        grads.append((loss.detach(), logp.grad))
    (plain, g_plain), (weighted, g_weighted) = grads
    assert torch.allclose(weighted, plain * w)
    assert torch.allclose(g_weighted, g_plain * w)  # ∂(w ℓ)/∂logp = w ∂ℓ/∂logp: no gradient through w


def test_config_is_validated_with_the_valid_choices():
    with pytest.raises(ValueError, match="none, token_tis, seq_tis, token_mask, seq_mask, geo_mask"):
        RolloutCorrection(mode="tis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip must be a finite number >= 1"):
        RolloutCorrection(mode="token_tis", clip=0.5)
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        RolloutCorrection(mode="token_mask", high=0.9)
    assert RolloutCorrection(mode="geo_mask").bounds() == (1.01, 1 / 1.01)
    from searchrl.algorithms.grpo import GRPOConfig

    cfg = from_dict(GRPOConfig, {"rollout_correction": {"mode": "seq_mask", "high": 3}}, key="algorithm")
    assert cfg.rollout_correction == RolloutCorrection(mode="seq_mask", high=3.0)
    with pytest.raises(ConfigError, match="geo_mask"):
        from_dict(GRPOConfig, {"rollout_correction": {"mode": "geo"}}, key="algorithm")


def _grpo(**corr):
    from searchrl.algorithms.grpo import GRPO, GRPOConfig

    return GRPO(GRPOConfig(kl_coef=1.0, rollout_correction=RolloutCorrection(**corr)), ctx=None)  # type: ignore[arg-type]


def _kl_term(algo, logp, ref, behaviour):
    """``with_kl``'s KL term and metrics on one-token rows, with the correction's weights from π_old = π_θ."""
    from types import SimpleNamespace

    mask = torch.ones_like(logp)
    w, _ = correction_weights(logp.detach(), behaviour, mask, algo.cfg.rollout_correction)
    extras = BatchExtras(ref_logp=ref, is_weight=w if algo.cfg.rollout_correction.mode != "none" else None)
    return algo.with_kl(torch.zeros_like(logp), {}, logp, None, SimpleNamespace(extras=extras))


def test_the_kl_term_is_weighted_by_the_correction_hand_computed():
    """π_θ = 0.1 on a token that the sampler (here the reference itself, a stale version 0) gave 0.5:
    ρ = 0.2, k3 = π_ref/π_θ − log(π_ref/π_θ) − 1 = 5 − log 5 − 1, and ρ·k3 = 1 − ρ + ρ log ρ."""
    logp, ref = torch.tensor([[math.log(0.1)]]), torch.tensor([[math.log(0.5)]])
    k3 = 5 - math.log(5) - 1
    loss, m = _kl_term(_grpo(mode="token_tis"), logp, ref, ref)
    assert float(m["kl_unweighted"]) == pytest.approx(k3, rel=1e-6)
    assert float(m["kl"]) == pytest.approx(0.2 * k3, rel=1e-6) == 1 - 0.2 + 0.2 * math.log(0.2)
    assert float(loss) == pytest.approx(0.2 * k3, rel=1e-6)  # β = 1
    loss, m = _kl_term(_grpo(mode="token_tis", weight_kl=False), logp, ref, ref)
    assert float(loss) == float(m["kl"]) == pytest.approx(k3, rel=1e-6) and "kl_unweighted" not in m
    loss, m = _kl_term(_grpo(mode="token_mask", high=1.5), logp, ref, ref)  # ρ = 0.2 rejected: no KL term
    assert float(loss) == 0.0 and float(m["kl_unweighted"]) == pytest.approx(k3, rel=1e-6)
    _, m = _kl_term(_grpo(mode="none"), logp, ref, ref)  # no correction: the paper's term
    assert float(m["kl"]) == pytest.approx(k3, rel=1e-6)


def test_the_weighted_kl_estimate_and_gradient_are_those_under_the_trainers_policy():
    """Tokens drawn from a stale sampler μ (the reference) for a policy π_θ that learned to avoid one of them:
    the weighted k3 and its gradient, averaged over the draws, are KL(π_θ ‖ π_ref) and the on-policy gradient
    Σ_a π_θ(a) ∇k3(a) (computed exactly over the 6 tokens); the unweighted ones are far off."""
    gen = torch.Generator().manual_seed(0)
    ref_p = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
    logits = torch.log(torch.tensor([0.002, 0.40, 0.30, 0.15, 0.10, 0.048]))
    pi = torch.softmax(logits, 0)
    exact = float((pi * (pi.log() - ref_p.log())).sum())
    theta = logits.clone().requires_grad_(True)
    k3 = lambda lp: torch.exp(ref_p.log() - lp) - (ref_p.log() - lp) - 1  # noqa: E731
    lp_all = torch.log_softmax(theta, 0)
    (want,) = torch.autograd.grad((pi.detach() * k3(lp_all)).sum(), theta)  # the on-policy expectation

    n = 400_000
    tokens = torch.multinomial(ref_p, n, replacement=True, generator=gen)
    for weight_kl in (True, False):
        theta = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, 0)[tokens][:, None]  # (n, 1)
        algo = _grpo(mode="token_tis", clip=1e3, weight_kl=weight_kl)  # a clip no ratio here reaches
        loss, m = _kl_term(algo, logp, ref_p.log()[tokens][:, None], ref_p.log()[tokens][:, None])
        (grad,) = torch.autograd.grad(loss.mean(), theta)
        estimate = float(m["kl"].mean())
        if weight_kl:
            assert estimate == pytest.approx(exact, rel=0.03)
            torch.testing.assert_close(grad, want, rtol=0.05, atol=5e-3)
        else:  # E_μ[k3] ≈ 0.3 · 150: the avoided token dominates
            assert estimate > 20 * exact and float((grad - want).abs().max()) > 1.0
