"""A micro-batch's common prefix run once through the KV cache (`models.prefix_cache`, ``trainer.prefix_cache_tokens``):
padded rows and rows packed as a prefix tree give the one-pass log-probs, entropies, values and gradients, on
the tiny Qwen2 model (full and LoRA, SDPA and eager) and on Qwen2.5's real vocabulary; activation
checkpointing falls back to one pass; a training step equals the step without it."""

import pytest
import torch

from searchrl.models.lean_head import add_lean_head
from searchrl.models.policy import PolicyWithValue, enable_checkpointing, forward_lean
from searchrl.models.prefix import attention_for, pack_shared
from searchrl.models.prefix_cache import cached_cost, common_prefix
from tests.engine.test_trainer import assert_same_gradients
from tests.models.test_packing import _load, assert_same_step, step_once, tree_rows

pytestmark = (
    pytest.mark.numerics
)  # two computation paths of the same numbers: CI runs them on a second float path


def test_common_prefix_counts_shared_real_tokens_and_leaves_each_row_one():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 4, 0], [5, 6, 7, 8, 2]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert common_prefix(ids, attn) == 3
    assert common_prefix(ids[[0, 2]], attn[[0, 2]]) == 4  # 5 tokens each: one left to each row
    short = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert common_prefix(ids, short) == 2  # the shortest row (3 tokens) keeps its last
    assert common_prefix(ids[:1], attn[:1]) == 0  # one row: nothing to share
    assert common_prefix(torch.tensor([[1, 2], [3, 2]]), torch.ones(2, 2)) == 0


def test_one_group_after_its_prompt_is_cheaper_padded_than_as_a_tree():
    """A group of 8 episodes of 256 tokens after a 2,048-token prompt: padded, each row sees the prompt and
    itself; as a tree, one 4,104-wide row whose dense mask spans all 8 (measured: 53.0 against 55.5 s at 8 of
    Qwen2.5-0.5B's layers on 2 CPU cores, `prefix_training.json`)."""
    assert cached_cost(8, 2048 + 256, 2048) < cached_cost(1, 2048 + 8 * 257 - 1, 2048)
    # four groups of short episodes behind one long system prompt: the tree shares each group's question too
    assert cached_cost(1, 600 + 4 * (40 + 8 * 60), 600) < cached_cost(32, 600 + 40 + 200, 600)


def _shared_rows(vocab, seed=2):
    """`tree_rows` without its unrelated last row: five rows that begin with one 60-token system prompt, two
    questions, and a branched episode whose first action (trained) two rows share."""
    ids, attn, loss = tree_rows(vocab, seed=seed)
    ids, attn, loss = ids[:5], attn[:5], loss[:5]
    width = int(attn.sum(-1).max())
    return ids[:, :width], attn[:, :width], loss[:, :width]


def _run(model, ids, attn, loss, prefix, packed=None, kind="sdpa"):
    """Log-probs, entropies, values (at the trained tokens) and gradients of ``loss``-weighted log-probs and
    squared values, padded or through ``packed`` (`models.prefix`)."""
    model.zero_grad(set_to_none=True)
    if packed is None:
        lp, ent, v = forward_lean(model, ids, attn, loss, 0.7, True, True, prefix=prefix)
    else:
        mask = attention_for(packed.attention, kind, torch.float32)
        out = forward_lean(
            model,
            packed.input_ids,
            mask,
            packed.loss_mask,
            0.7,
            True,
            True,
            position_ids=packed.position_ids,
            prefix=prefix,
        )
        lp, ent, v = (packed.unpack(x) for x in out)
    ((lp * loss).sum() + (v * loss).pow(2).sum()).backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    return lp.detach(), ent, (v * loss).detach(), grads


def _assert_equal(a, b):
    (lp0, e0, v0, g0), (lp1, e1, v1, g1) = a, b
    assert (lp0 - lp1).abs().max() < 1e-5 and (v0 - v1).abs().max() < 1e-5
    assert (e0 - e1).abs().max() < 4e-5
    assert g0.keys() == g1.keys() and g0
    # gradients summed over ~100 tokens: equal to 1e-5 of each tensor's largest entry (float32 sums reordered)
    assert max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) for k in g0) < 1e-5


@pytest.mark.parametrize("kind", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_cached_prefix_equals_one_pass_padded_and_packed(tiny_model_dir, lora, kind):
    lm = add_lean_head(_load(tiny_model_dir))
    lm.config._attn_implementation = kind
    if lora:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(
            lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
    model = PolicyWithValue(lm)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = _shared_rows(model.config.vocab_size)
    n = common_prefix(ids, attn)
    assert n == 60  # the system prompt
    whole = _run(model, ids, attn, loss, 0)
    _assert_equal(whole, _run(model, ids, attn, loss, n))  # padded rows against the prefix's cache
    p = pack_shared(ids, attn, loss)
    assert p is not None and p.attention is not None
    _assert_equal(whole, _run(model, ids, attn, loss, n, p, kind))  # the prefix tree after the prefix
    _assert_equal(whole, _run(model, ids, attn, loss, 17, p, kind))  # any shorter prefix too


def test_checkpointing_runs_the_rows_whole(tiny_model_dir):
    """Activation checkpointing drops a KV cache in training; the prefix is then not cached, same numbers."""
    model = add_lean_head(_load(tiny_model_dir))
    enable_checkpointing(model)
    model.train()
    ids, attn, loss = _shared_rows(model.config.vocab_size)
    calls = []
    base = model.base_model
    real = base.forward

    def counted(*a, **kw):
        calls.append(kw.get("input_ids").shape)
        return real(*a, **kw)

    base.forward = counted
    lp0 = forward_lean(model, ids, attn, loss, 1.0)[0]
    lp1 = forward_lean(model, ids, attn, loss, 1.0, prefix=60)[0]
    assert len(calls) == 2 and calls[0] == calls[1] == ids.shape  # one whole pass each
    assert (lp0 - lp1).abs().max() < 1e-6
    model.eval()
    calls.clear()
    with torch.no_grad():
        lp2 = forward_lean(model, ids, attn, loss, 1.0, prefix=60)[0]
    assert [tuple(c) for c in calls] == [(1, 60), (5, ids.shape[1] - 60)]  # no gradient: the cache is used
    assert (lp0 - lp2).abs().max() < 1e-5


def test_the_cached_prefix_on_qwens_real_vocabulary(qwen_model_dir, qwen_tok):
    """Chat rows at Qwen2.5's 151,936-row vocabulary behind one system prompt with a tool schema: log-probs,
    entropies and gradients with the system prompt cached equal one pass, padded and as a prefix tree."""
    from transformers import AutoModelForCausalLM

    model = add_lean_head(AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32))
    system = (
        '<|im_start|>system\nYou can call {"name": "search", "parameters": {"query": "string"}}.<|im_end|>\n'
    )
    turns = [
        ("<|im_start|>user\nWho directed Keve?<|im_end|>\n", "<|im_start|>assistant\nAnn Lee<|im_end|>"),
        ("<|im_start|>user\nWho directed Keve?<|im_end|>\n", "<|im_start|>assistant\nBo<|im_end|>"),
        ("<|im_start|>user\nWhere was Ann Lee born?<|im_end|>\n", "<|im_start|>assistant\nParis<|im_end|>"),
    ]
    rows, masks = [], []
    for user, answer in turns:
        a = qwen_tok(system + user, add_special_tokens=False)["input_ids"]
        b = qwen_tok(answer, add_special_tokens=False)["input_ids"]
        rows.append(a + b)
        masks.append([0] * len(a) + [1] * len(b))
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    loss = torch.tensor([m + [0] * (T - len(m)) for m in masks]).float()
    n = common_prefix(ids, attn)
    assert n >= len(qwen_tok(system, add_special_tokens=False)["input_ids"])

    def run(prefix, packed=None):
        model.zero_grad(set_to_none=True)
        if packed is None:
            lp, ent, _ = forward_lean(model, ids, attn, loss, 1.0, True, prefix=prefix)
        else:
            lp, ent, _ = forward_lean(
                model,
                packed.input_ids,
                attention_for(packed.attention, "sdpa", torch.float32),
                packed.loss_mask,
                1.0,
                True,
                position_ids=packed.position_ids,
                prefix=prefix,
            )
            lp, ent = packed.unpack(lp), packed.unpack(ent)
        (lp * loss).sum().backward()
        return (
            lp.detach(),
            ent,
            {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None},
        )

    lp0, e0, g0 = run(0)
    p = pack_shared(ids, attn, loss)
    assert p is not None and p.attention is not None
    for lp1, e1, g1 in (run(n), run(n, p)):
        assert (lp0 - lp1).abs().max() < 1e-5
        assert (e0 - e1).abs().max() < 4e-5  # entropies over 151,936 rows: see test_packing's bound
        assert_same_gradients(g0, g1, rel=1e-5)


@pytest.mark.parametrize("layout", ["padded", "packed", "tree"])
def test_a_training_step_with_a_cached_prefix_equals_one_without(make_exp, tmp_path, layout, monkeypatch):
    """GRPO with a KL term (the reference pass too) and one update: the same episodes, loss, gradient norm and
    gradients with every micro-batch's common prompt cached (``prefix_cache_tokens: 2``) as without it; without
    packing, with it (the rows after the prefix padded or as a tree, whichever `cached_cost` finds cheaper), and
    packed with the tree forced."""
    import searchrl.engine.step as step_module

    if layout == "tree":
        monkeypatch.setattr(step_module, "cached_cost", lambda rows, width, prefix: rows)
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    calls: list[int] = []

    def counted(tr):
        real = tr.training_step._cached_prefix
        tr.training_step._cached_prefix = lambda m, b: calls.append(real(m, b)) or calls[-1]

    runs = [
        step_once(
            exp,
            tmp_path / f"c{cached}",
            "grpo",
            {"kl_coef": 0.01},
            counted,
            packing=layout != "padded",
            prefix_cache_tokens=cached,
        )
        for cached in (None, 2)
    ]
    assert any(calls[len(calls) // 2 :]) and not any(calls[: len(calls) // 2])  # the prompts were cached
    assert_same_step([m for m, _ in runs], [g for _, g in runs])
