"""Rollout correction: each mode against a hand-computed case and against a loop-by-loop reference written
from verl's rollout_corr formulas (docs/algo/rollout_corr_math.md §3.3-3.4, §4.1) on random inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.algorithms.correction import MODES, RolloutCorrection, correction_weights, effective_sample_size
from searchrl.core.config import ConfigError, from_dict

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
        extras = {"old_logp": old, "advantages": adv, **({"is_weight": weight} if weight is not None else {})}
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
