import math

import pytest
import torch

from searchrl.core.functional import (
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    token_entropy,
    token_logprobs,
    token_weights,
)


def test_token_logprobs_match_log_softmax_and_mask_path():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6))
    ref = torch.zeros(3, 6)
    for b in range(3):
        for t in range(1, 6):
            ref[b, t] = torch.log_softmax(logits[b, t - 1] / 0.7, -1)[ids[b, t]]
    full = token_logprobs(logits, ids, temperature=0.7)
    assert torch.allclose(full, ref, atol=1e-6)
    mask = (torch.rand(3, 6) > 0.5).float()
    mask[:, 0] = 0
    part = token_logprobs(logits, ids, temperature=0.7, mask=mask)
    assert torch.allclose(part, ref * mask, atol=1e-6)
    g1 = torch.autograd.grad((full * mask).sum(), logits)[0]
    g2 = torch.autograd.grad(part.sum(), logits)[0]
    assert torch.allclose(g1, g2, atol=1e-6)


def test_entropy():
    logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert torch.allclose(token_entropy(logits, mask), torch.tensor([[0.0, math.log(4), math.log(4)]]))


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    lr = math.log(0.5) - math.log(0.25)  # log π/π_ref = log 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(lr)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * lr**2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - math.log(0.5))  # r = 1/2
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_clamp_bounds_the_estimate_like_verl():
    logp, ref = torch.tensor([0.0]), torch.tensor([5.0])  # log π/π_ref = −5: k3 = e^5 − 1 − 5 = 142.41
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(5) - 6)
    assert kl_penalty(logp, ref, "k3", clamp=10.0).item() == 10.0
    assert kl_penalty(ref, logp, "k1", clamp=10.0).item() == pytest.approx(5.0)  # inside the bound: unchanged
    assert kl_penalty(logp, ref, "k1", clamp=2.0).item() == -2.0


def test_whitening_uses_the_unbiased_variance_by_default():
    x, m = torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2; squared deviations 1, 0, 1: biased var 2/3, unbiased (verl, TRL) 1
    assert masked_var(x, m).item() == pytest.approx(2 / 3)
    assert masked_var(x, m, unbiased=True).item() == pytest.approx(1.0)
    assert masked_whiten(x, m).tolist()[0] == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_masked_stats():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert masked_mean(x, m).item() == pytest.approx(2.5)
    w = masked_whiten(x, m)
    assert masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-6)
    assert (w[:, 2] == 0).all()


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"]
)
def test_loss_aggregation_independent_of_split(mode):
    """The global aggregation gives the same loss for any micro-batch split (docs/design.md §4.5)."""
    torch.manual_seed(1)
    loss = torch.randn(8, 10)
    mask = (torch.rand(8, 10) > 0.4).float()
    g_tok, g_seq = float(mask.sum()), 8.0
    whole = (loss * token_weights(mask, mode, g_tok, g_seq, 10)).sum()
    parts = sum(
        (loss[i : i + 3] * token_weights(mask[i : i + 3], mode, g_tok, g_seq, 10)).sum()
        for i in range(0, 8, 3)
    )
    assert torch.allclose(whole, parts)
    if mode == "token-mean":
        assert whole.item() == pytest.approx(float((loss * mask).sum() / mask.sum()), rel=1e-5)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1)
        assert whole.item() == pytest.approx(float(per_seq.mean()), rel=1e-5)
