"""Shared-prefix training (`models.prefix`, `trainer.share_prefix`) on a CUDA GPU: run by
`benchmarks/gpu_session.sh prefix-tests` on a lent GPU, never in CPU CI. Float32 (matrix products without TF32):
the prefix tree's log-probs, values and gradients equal the padded batch's with full parameters and LoRA, and on
Qwen2.5's real vocabulary through the lean head; in bfloat16 the gap between the two layouts is printed and held
to bf16's rounding (two summation orders of bf16 numbers: no exact equality to assert). The whole training step, shared against padded,
is `tests/models/test_packing.py::test_a_training_step_packed_equals_padded`, which runs on the GPU where one
is (the trainer's accelerator takes it)."""

from __future__ import annotations

import pytest
import torch

from searchrl.models.lean_head import add_lean_head
from searchrl.models.policy import PolicyWithValue, forward_lean
from searchrl.models.prefix import attention_for, pack_shared

from ..helpers import gpu_only
from .test_packing import _load, padded_and_packed, tree_rows

pytestmark = gpu_only()


def _gaps(model, dtype):
    """Largest gaps between the padded and the tree-packed batch on the GPU: log-probs, values, and gradients
    relative to each tensor's largest entry."""
    model = model.to("cuda", dtype)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = (t.cuda() for t in tree_rows(model.config.vocab_size, seed=2))
    p = pack_shared(ids, attn, loss)
    assert p is not None and p.input_ids.is_cuda and p.attention.is_cuda
    mask = attention_for(p.attention, "sdpa", dtype)
    (lp0, v0, g0), (lp1, v1, g1) = padded_and_packed(model, ids, attn, loss.to(dtype), p, mask)
    assert g0.keys() == g1.keys() and g0
    grad = max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) for k in g0)
    return float((lp0 - lp1).abs().max()), float((v0 - v1).abs().max()), grad


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(
    "dtype, tol",
    # bf16 has 8 bits of mantissa: the two layouts add in other orders, so they agree to bf16's rounding only
    # (a few units of its last place; a wrong mask is off by far more)
    [(torch.float32, (1e-5, 1e-5, 1e-5)), (torch.bfloat16, (0.25, 0.05, 0.1))],
    ids=["float32", "bfloat16"],
)
def test_prefix_tree_equals_padded_on_a_gpu(tiny_model_dir, lora, dtype, tol):
    model = PolicyWithValue(_load(tiny_model_dir, lora))
    gaps = _gaps(model, dtype)
    print(f"\nprefix tree vs padded, {dtype}, {'lora' if lora else 'full'}: log-prob, value, grad", gaps)
    assert all(g < t for g, t in zip(gaps, tol))


def test_prefix_tree_lean_path_on_qwens_vocabulary_on_a_gpu(qwen_model_dir):
    """Qwen2.5's 151,936-row head through the lean path, on the GPU: per-token log-probs and entropies."""
    from transformers import AutoModelForCausalLM

    model = add_lean_head(AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32)).cuda()
    ids, attn, loss = (t.cuda() for t in tree_rows(model.config.vocab_size, seed=5))
    p = pack_shared(ids, attn, loss)
    mask = attention_for(p.attention, "sdpa", torch.float32)
    lp0, e0, _ = forward_lean(model, ids, attn, loss, 1.0, entropy=True)
    lp1, e1, _ = forward_lean(
        model, p.input_ids, mask, p.loss_mask, 1.0, entropy=True, position_ids=p.position_ids
    )
    gap = max(float((lp0 - p.unpack(lp1)).abs().max()), float((e0 - p.unpack(e1)).abs().max()))
    print(f"\nprefix tree vs padded, Qwen2.5 vocabulary, lean path: {gap:.2e}")
    assert gap < 1e-5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_cached_prefix_equals_one_pass_on_a_gpu(tiny_model_dir, lora):
    """The micro-batch's common prefix run once through the KV cache (`models.prefix_cache`, float32 on the GPU):
    padded rows and the prefix tree after it give one pass's log-probs, entropies, values and gradients."""
    from .test_prefix_cache import _assert_equal, _run, _shared_rows

    lm = add_lean_head(_load(tiny_model_dir))
    if lora:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(
            lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    model = PolicyWithValue(lm).cuda()
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = (t.cuda() for t in _shared_rows(model.config.vocab_size))
    p = pack_shared(ids, attn, loss)
    whole = _run(model, ids, attn, loss, 0)
    _assert_equal(whole, _run(model, ids, attn, loss, 60))
    _assert_equal(whole, _run(model, ids, attn, loss, 60, p))
