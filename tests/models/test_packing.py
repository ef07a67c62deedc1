"""Sequence packing (`models.packing`, `trainer.packing`): a packed micro-batch gives the padded batch's
log-probs, values and gradients, on the tiny Qwen2 model, under LoRA, and through a whole training step."""

import pytest
import torch

from searchrl.core.config import TrainerConfig
from searchrl.core.functional import token_logprobs
from searchrl.models.lean_head import add_lean_head
from searchrl.models.packing import pack, padding_fraction
from searchrl.models.policy import PolicyWithValue, forward, forward_lean
from searchrl.models.prefix import attention_for, pack_shared, prefix_mask_kind
from tests.engine.test_trainer import assert_same_gradients, gradients_at_update, trainer_for

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


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


def padded_and_packed(model, ids, attn, loss, p, mask):
    """Log-probs (temperature 0.7), values and gradients of a value-headed model on the padded batch and on
    its packing ``p`` (``mask``: the packed rows' 4-D attention mask, or None for position-id packing)."""

    def run(packed):
        model.zero_grad()
        if packed:
            logits, v = forward(model, p.input_ids, mask, values=True, position_ids=p.position_ids)
            lp = p.unpack(token_logprobs(logits, p.input_ids, 0.7, mask=p.loss_mask))
            v = p.unpack(v)
        else:
            logits, v = forward(model, ids, attn, values=True)
            lp = token_logprobs(logits, ids, 0.7, mask=loss)
        ((lp * loss).sum() + (v * loss).pow(2).sum()).backward()
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        return lp.detach(), (v * loss).detach(), grads

    return run(False), run(True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_equals_padded_logprobs_values_and_gradients(tiny_model_dir, lora):
    model = PolicyWithValue(_load(tiny_model_dir, lora))
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = right_padded(model.config.vocab_size, [40, 9, 27, 33], seed=1)
    p = pack(ids, attn, loss)
    (lp0, v0, g0), (lp1, v1, g1) = padded_and_packed(model, ids, attn, loss, p, None)
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


def step_padded_and_packed(exp, tmp_path, algorithm, args, lean):
    """One training step of ``algorithm`` padded, then packed, from the same seed: its metrics and the
    gradients the update received (unclipped).

    Gradients, not the weights after the step: under Adam an entry whose gradient is ~0 moves by up to the
    learning rate in whichever direction float rounding gives it, so weights after an Adam step differ by a
    fraction of lr between two summation orders on some CPUs (5.4e-5 at lr 5e-3 on an AMD EPYC)."""
    grads, metrics = [], []
    for packing in (False, True):
        cfg = TrainerConfig(
            steps=1,
            batch_size=2,
            micro_batch_size=4,
            lr=5e-3,
            max_grad_norm=1e9,
            save_every=10**6,
            packing=packing,
            lean_logprobs=lean,
        )
        tr = trainer_for(exp, algorithm, cfg, args=args, out=tmp_path / f"p{packing}")
        got = gradients_at_update(tr)
        torch.manual_seed(0)
        metrics.append(tr.step(0))
        grads.append(got)
    return metrics, grads


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full-logits"])
def test_a_training_step_packed_equals_padded(make_exp, tmp_path, lean):
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    metrics, grads = step_padded_and_packed(exp, tmp_path, "grpo", {"kl_coef": 0.01}, lean)
    assert metrics[0]["rollout/tokens_generated"] == metrics[1]["rollout/tokens_generated"]  # same episodes
    assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"], abs=1e-5)
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"], rel=1e-4, abs=1e-6)
    assert_same_gradients(*grads)


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


# ------------------------------------------------------------------ shared contexts (`models.prefix`)
def candidates(vocab, context, suffixes, others=(), seed=0):
    """Rows that share a ``context``-token context and then differ (``suffixes`` tokens each, all trained), and
    unrelated rows (``others``: lengths, a 3-token prompt), right-padded."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, vocab, (context,), generator=g)
    rows = [(torch.cat([ctx, torch.randint(3, vocab, (n,), generator=g)]), context) for n in suffixes]
    rows += [(torch.randint(3, vocab, (n,), generator=g), 3) for n in others]
    T = max(len(r) for r, _ in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros(len(rows), T)
    for b, (r, first) in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)], loss[b, first : len(r)] = r, 1, 1
    return ids, attn, loss


def test_shared_context_layout():
    ids, attn, loss = candidates(50, 6, [2, 3, 1], others=[4])
    p = pack_shared(ids, attn, loss)
    # the context but its last token once, then that token and each candidate's rest
    assert p.input_ids[0].tolist()[:5] == ids[0, :5].tolist()
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 5, 6]
    assert torch.equal(p.unpack(p.input_ids), ids) and torch.equal(p.unpack(p.loss_mask), loss)
    a = p.attention[0, 0]
    assert (
        a[7, :5].all() and a[7, 5:8].all() and not a[7, 8:].any()
    )  # candidate 1 sees the context and itself
    assert a[10, :5].all() and not a[10, 5:8].any() and a[10, 8:11].all()  # candidate 2 not candidate 1
    assert not a[:5, 5:].any()  # the context sees none of them
    assert p.attention.any(-1).all()  # every query attends somewhere (padding: itself)
    assert pack_shared(*right_padded(50, [5, 2, 4])) is None  # nothing shared: plain packing
    # a long suffix costs more as one row than as separate rows: not shared
    assert pack_shared(*candidates(50, 3, [900, 900])) is None


@pytest.mark.parametrize("kind", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_shared_context_equals_padded(tiny_model_dir, lora, kind):
    model = PolicyWithValue(_load(tiny_model_dir, lora))
    lm = model.lm.get_base_model() if lora else model.lm
    lm.config._attn_implementation = kind
    assert prefix_mask_kind(model) == kind
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = candidates(model.config.vocab_size, 30, [6, 11, 4, 8], others=[17, 9], seed=3)
    p = pack_shared(ids, attn, loss)
    assert len(set(p.src.tolist())) == attn.sum() - 3 * 29  # the context ran once for its four rows

    mask = attention_for(p.attention, kind, torch.float32)
    (lp0, v0, g0), (lp1, v1, g1) = padded_and_packed(model, ids, attn, loss, p, mask)
    assert (lp0 - lp1).abs().max() < 1e-5 and (v0 - v1).abs().max() < 1e-5
    assert g0.keys() == g1.keys() and g0
    assert max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) for k in g0) < 1e-5


def test_shared_context_lean_path_on_qwens_real_vocabulary(tmp_path):
    """SLATE-like candidates on Qwen2.5's vocabulary: one recorded state, three different next actions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from searchrl.models.tiny import build_local_model

    out = build_local_model("tiny", [], tmp_path / "qwen-vocab", tokenizer="qwen2.5", layers=1)
    tok = AutoTokenizer.from_pretrained(out)
    model = add_lean_head(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    state = tok("Question: who directed Lalshul?\n<think> find the film </think>\n")["input_ids"]
    actions = ["<search> Lalshul director</search>", "<answer> X</answer>", "<search>Lalshul</search>"]
    rows = [state + tok(a)["input_ids"] for a in actions]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    loss = attn.float().clone()
    loss[:, : len(state)] = 0
    p = pack_shared(ids, attn, loss)
    assert p is not None and p.input_ids.shape[0] == 1
    mask = attention_for(p.attention, "sdpa", torch.float32)
    lp0, e0, _ = forward_lean(model, ids, attn, loss, 1.0, entropy=True)
    lp1, e1, _ = forward_lean(
        model, p.input_ids, mask, p.loss_mask, 1.0, entropy=True, position_ids=p.position_ids
    )
    assert (lp0 - p.unpack(lp1)).abs().max() < 1e-5 and (e0 - p.unpack(e1)).abs().max() < 1e-5


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full-logits"])
def test_a_slate_step_with_shared_contexts_equals_padded(make_exp, tmp_path, lean, monkeypatch):
    """SLATE trains on k candidates of one step from a shared state: a packed step shares each state."""
    import searchrl.engine.step as step_mod

    calls = []
    real = step_mod.pack_shared

    def counted(*a):
        out = real(*a)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(step_mod, "pack_shared", counted)
    from searchrl.rewards.judges import JUDGES
    from tests.engine.test_trainer import LengthJudge

    if "test_length" not in JUDGES:
        JUDGES.add("test_length", LengthJudge)
    exp = make_exp("rollout.temperature=1.0")
    metrics, grads = step_padded_and_packed(exp, tmp_path, "slate", {"k": 4, "judge": "test_length"}, lean)
    assert any(calls)  # the candidates' states were shared
    assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"], abs=1e-5)
    assert_same_gradients(*grads)
