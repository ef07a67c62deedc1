"""The ``prefix_kv`` and ``shared_kv`` modes of `benchmarks/prefix_training.py` (`benchmarks/shared_prefix.py`'s
`cached_prefix_logprobs`: the trainer's path with a micro-batch's common prefix run once, its keys and values
reused by every row, padded or packed as a prefix tree) measure what they claim: the padded pass's log-probs and
gradients on Qwen2.5's vocabulary, so their timings compare the same numbers."""

import importlib.util
from pathlib import Path

import pytest
import torch

from searchrl.models.lean_head import add_lean_head
from searchrl.models.policy import forward_lean
from tests.helpers import qwen_model

# loaded from its file, not through sys.path: the benchmarks folder holds modules named like installed packages
# (benchmarks/coverage.py), which would shadow them for every later import in this process and its children
_SPEC = importlib.util.spec_from_file_location(
    "benchmarks_shared_prefix", Path(__file__).resolve().parents[2] / "benchmarks" / "shared_prefix.py"
)
assert _SPEC is not None and _SPEC.loader is not None
_BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_BENCH)
cached_prefix_logprobs = _BENCH.cached_prefix_logprobs

pytestmark = pytest.mark.numerics
VOCAB = 151936


def _model():
    """A random Qwen2 with Qwen2.5's 151,936 output rows (`tests.helpers.qwen_model`), through the lean head."""
    return add_lean_head(qwen_model())


def _rows(prefix: int, own: list[int], seed: int = 0):
    """Right-padded rows that begin with one ``prefix``-token prompt, then their own (trained) tokens."""
    g = torch.Generator().manual_seed(seed)
    T = prefix + max(own)
    ids, attn = torch.zeros(len(own), T, dtype=torch.long), torch.zeros(len(own), T, dtype=torch.long)
    mask = torch.zeros(len(own), T)
    shared = torch.randint(3, VOCAB, (prefix,), generator=g)
    for b, n in enumerate(own):
        ids[b, :prefix], ids[b, prefix : prefix + n] = shared, torch.randint(3, VOCAB, (n,), generator=g)
        attn[b, : prefix + n], mask[b, prefix : prefix + n] = 1, 1
    return ids, attn, mask


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["prefix_kv", "shared_kv"])
@pytest.mark.parametrize("own", [[12, 12, 12], [7, 15, 3, 11]])
def test_prefix_kv_equals_the_padded_pass(own, packed):
    model = _model()
    ids, attn, mask = _rows(40, own)
    ref = forward_lean(model, ids, attn, mask, 1.0)[0]
    (ref * mask).sum().backward()
    want = _grads(model)
    got, ran = cached_prefix_logprobs(model, ids, attn, mask, packed)
    (got * mask).sum().backward()
    grads = _grads(model)
    padded = 40 + len(own) * (ids.shape[1] - 40)  # the prefix once, then each row's own columns
    tree = 40 + sum(own) + len(own) - 1  # the prefix once, each row's own tokens and the repeat at its head
    assert ran == padded or (packed and ran == tree)
    assert torch.allclose(got * mask, ref * mask, atol=1e-5, rtol=1e-4)
    for name, g in want.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-3), name


def test_prefix_kv_without_a_shared_prefix_runs_padded():
    model = _model()
    ids, attn, mask = _rows(40, [10, 10])
    ids[1, 0] = (ids[0, 0] + 1) % VOCAB  # the rows differ from their first token
    got, ran = cached_prefix_logprobs(model, ids, attn, mask)
    assert ran == ids.numel()
    assert torch.allclose(got, forward_lean(model, ids, attn, mask, 1.0)[0], atol=1e-6)
