"""Sequence packing (`models.packing`, `trainer.packing`): a packed micro-batch gives the padded batch's
log-probs, values and gradients, on the tiny Qwen2 model, under LoRA, and through a whole training step."""

import pytest
import torch

from searchrl.core.config import TrainerConfig
from searchrl.core.functional import token_logprobs
from searchrl.models.lean_head import add_lean_head
from searchrl.models.packing import pack, padding_fraction
from searchrl.models.policy import PolicyWithValue, forward, forward_lean
from tests.engine.test_trainer import state, trainer_for


def right_padded(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    attn = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    loss = attn.clone().float()
    loss[:, :3] = 0  # a prompt of three tokens
    ids = ids * attn  # pad id 0
    return ids, attn, loss


def test_pack_layout_and_unpack():
    ids, attn, loss = right_padded(50, [5, 2, 4])
    one = pack(ids, attn, loss, capacity=11)  # everything in one row, longest first
    assert one.input_ids.shape == (1, 11) and one.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    p = pack(ids, attn, loss, capacity=6)  # first fit: [5 + tail], [4 + 2]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1]]
    assert pack(ids, attn, loss).input_ids.shape == (3, 5)  # default capacity: the longest sequence
    for q in (one, p, pack(ids, attn, loss)):
        assert torch.equal(q.unpack(q.input_ids), ids) and torch.equal(q.unpack(q.loss_mask), loss)
    assert padding_fraction(attn) == pytest.approx(1 - 11 / 15)
    with pytest.raises(ValueError, match="right-padded"):
        pack(ids, torch.tensor([[0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]), loss)


def _load(tiny_model_dir, lora=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(
            m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    return m


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_equals_padded_logprobs_values_and_gradients(tiny_model_dir, lora):
    model = PolicyWithValue(_load(tiny_model_dir, lora))
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = right_padded(model.config.vocab_size, [40, 9, 27, 33], seed=1)
    p = pack(ids, attn, loss)

    def run(packed):
        model.zero_grad()
        if packed:
            logits, v = forward(model, p.input_ids, None, values=True, position_ids=p.position_ids)
            lp = p.unpack(token_logprobs(logits, p.input_ids, 0.7, mask=p.loss_mask))
            v = p.unpack(v)
        else:
            logits, v = forward(model, ids, attn, values=True)
            lp = token_logprobs(logits, ids, 0.7, mask=loss)
        ((lp * loss).sum() + (v * loss).pow(2).sum()).backward()
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        return lp.detach(), (v * loss).detach(), grads

    lp0, v0, g0 = run(False)
    lp1, v1, g1 = run(True)
    assert (lp0 - lp1).abs().max() < 1e-5 and (v0 - v1).abs().max() < 1e-5
    assert g0.keys() == g1.keys() and g0
    # gradients summed over ~100 tokens: equal to 1e-5 of each tensor's largest entry (float32 sums reordered)
    assert max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) for k in g0) < 1e-5


def test_packed_lean_path(tiny_model_dir):
    model = add_lean_head(_load(tiny_model_dir))
    ids, attn, loss = right_padded(model.config.vocab_size, [12, 30, 5], seed=2)
    p = pack(ids, attn, loss)
    lp0, e0, _ = forward_lean(model, ids, attn, loss, 1.0, entropy=True)
    lp1, e1, _ = forward_lean(
        model, p.input_ids, None, p.loss_mask, 1.0, entropy=True, position_ids=p.position_ids
    )
    assert (lp0 - p.unpack(lp1)).abs().max() < 1e-5 and (e0 - p.unpack(e1)).abs().max() < 1e-5


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full-logits"])
def test_a_training_step_packed_equals_padded(make_exp, tmp_path, lean):
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    after, metrics = [], []
    for packing in (False, True):
        cfg = TrainerConfig(
            steps=1,
            batch_size=2,
            micro_batch_size=4,
            lr=5e-3,
            save_every=10**6,
            packing=packing,
            lean_logprobs=lean,
        )
        tr = trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.01}, out=tmp_path / f"p{packing}")
        torch.manual_seed(0)
        metrics.append(tr.step(0))
        after.append(state(tr.policy))
    assert metrics[0]["rollout/tokens_generated"] == metrics[1]["rollout/tokens_generated"]  # same episodes
    assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"], abs=1e-5)
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"], rel=1e-4, abs=1e-6)
    # Adam divides by √v: an entry whose gradient is ~0 moves by up to lr whatever its sign, so float rounding
    # shows in the weights at a fraction of lr (the gradients themselves agree to 1e-5, test above)
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in after[0]) < 0.01 * 5e-3


def test_packed_equals_padded_on_qwens_real_vocabulary(tmp_path):
    """Qwen2.5's 151,936-row vocabulary, tags as text (`<search>` spans tokens, `</search>` merges with its
    neighbours): real episodes of different lengths, packed, give the padded log-probs and entropies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from searchrl.models.tiny import build_local_model

    out = build_local_model("tiny", [], tmp_path / "qwen-vocab", tokenizer="qwen2.5", layers=1)
    tok = AutoTokenizer.from_pretrained(out)
    model = add_lean_head(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    texts = [
        "Question: who directed Lalshul?\n<think> find the film </think>\n<search> Lalshul director</search>",
        "Question: where?\n<answer> X</answer>",
        "Question: which city?\n<search> X born in</search>",
    ]
    rows = [tok(t)["input_ids"] for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    loss = attn.float().clone()
    loss[:, :4] = 0
    p = pack(ids, attn, loss)
    assert p.input_ids.shape[0] < len(rows)  # the two short episodes share a row
    lp0, e0, _ = forward_lean(model, ids, attn, loss, 1.0, entropy=True)
    lp1, e1, _ = forward_lean(
        model, p.input_ids, None, p.loss_mask, 1.0, entropy=True, position_ids=p.position_ids
    )
    assert (lp0 - p.unpack(lp1)).abs().max() < 1e-5 and (e0 - p.unpack(e1)).abs().max() < 1e-5
