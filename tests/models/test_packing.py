"""Sequence packing (`models.packing`, `trainer.packing`): a packed micro-batch gives the padded batch's
log-probs, values and gradients, on the tiny Qwen2 model, under LoRA, and through a whole training step."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def step_once(exp, out, algorithm, args, before=None, **settings):
    """One training step of ``algorithm`` from seed 0 with the trainer ``settings``: its metrics and the
    gradients the update received (unclipped). ``before(trainer)`` runs first (to instrument it)."""
    cfg = TrainerConfig(
        steps=1, batch_size=2, micro_batch_size=4, lr=5e-3, max_grad_norm=1e9, save_every=10**6, **settings
    )
    tr = trainer_for(exp, algorithm, cfg, args=args, out=out)
    got = gradients_at_update(tr)
    if before is not None:
        before(tr)
    torch.manual_seed(0)
    return tr.step(0), got


def assert_same_step(metrics, grads):
    """Two steps' metrics and gradients (`step_once`) agree: the same episodes, loss, norm and gradients."""
    assert metrics[0]["rollout/tokens_generated"] == metrics[1]["rollout/tokens_generated"]  # same episodes
    assert metrics[0]["train/loss"] == pytest.approx(metrics[1]["train/loss"], abs=1e-5)
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"], rel=1e-4, abs=1e-6)
    assert_same_gradients(*grads)


def step_padded_and_packed(exp, tmp_path, algorithm, args, lean):
    """One training step of ``algorithm`` padded, then packed, from the same seed: its metrics and the
    gradients the update received (unclipped).

    Gradients, not the weights after the step: under Adam an entry whose gradient is ~0 moves by up to the
    learning rate in whichever direction float rounding gives it, so weights after an Adam step differ by a
    fraction of lr between two summation orders on some CPUs (5.4e-5 at lr 5e-3 on an AMD EPYC)."""
    runs = [
        step_once(exp, tmp_path / f"p{packing}", algorithm, args, packing=packing, lean_logprobs=lean)
        for packing in (False, True)
    ]
    return [m for m, _ in runs], [g for _, g in runs]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full-logits"])
def test_a_training_step_packed_equals_padded(make_exp, tmp_path, lean):
    exp = make_exp("rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]")
    assert_same_step(*step_padded_and_packed(exp, tmp_path, "grpo", {"kl_coef": 0.01}, lean))


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
    assert (lp0 - p.unpack(lp1)).abs().max() < 1e-5
    # An entropy here is a float32 sum over 151,936 rows near log(151936) = 11.93, where one ulp is 9.5e-7: the
    # padded and packed shapes sum in different orders, ~11 ulps apart on ATen's portable kernels (1.05e-5, the
    # second floating-point path of .ci/run). 4e-5 stays below the spread between positions (~1e-4).
    assert (e0 - p.unpack(e1)).abs().max() < 4e-5


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
    # the context once, then for each further candidate its context's last token again and its rest: 14 columns,
    # the unrelated row in a row of its own; positions restart at 5 at each candidate's segment
    pos0 = p.position_ids[0].tolist()
    assert p.input_ids.shape == (2, 14) and pos0[:5] == [0, 1, 2, 3, 4] and pos0.count(5) == 3
    assert torch.equal(p.unpack(p.input_ids), ids) and torch.equal(p.unpack(p.loss_mask), loss)
    assert_tree_invariants(p, ids, attn)
    assert not p.attention[0, 0, :5, 5:].any()  # the context sees no candidate
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
    assert len(set(p.src.tolist())) == attn.sum() - 3 * 30  # the context is read once for its four rows

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


# ------------------------------------------------------------------ prefix trees (`models.prefix`)
def tree_rows(vocab, seed=0, system_n=60):
    """Rows as a GRPO step on the tool format and branched episodes make them: a 60-token system prompt every row
    begins with; question A's prompt (5 more) with two episodes that share their first action (4 trained tokens)
    and observation (3) and then differ, and a third that differs from its first action on; question B's prompt
    with two episodes; and one row that shares nothing. Loss on action tokens only, shared ones included."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    system, qa, qb = r(system_n), r(5), r(6)
    act, obs = r(4), r(3)
    spans = [  # (tokens, trained) pieces per row
        [(system + qa, 0), (act, 1), (obs, 0), (r(5), 1)],
        [(system + qa, 0), (act, 1), (obs, 0), (r(7), 1)],
        [(system + qa, 0), (r(6), 1)],
        [(system + qb, 0), (r(9), 1)],
        [(system + qb, 0), (r(4), 1)],
        [(r(10), 0), (r(5), 1)],
    ]
    rows = [[t for toks, _ in s for t in toks] for s in spans]
    masks = [[m for toks, m in s for _ in toks] for s in spans]
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros(len(rows), T)
    for b, (row, m) in enumerate(zip(rows, masks)):
        ids[b, : len(row)], attn[b, : len(row)], loss[b, : len(m)] = (
            torch.tensor(row),
            1,
            torch.tensor(m).float(),
        )
    return ids, attn, loss


def assert_tree_invariants(p, ids, attn):
    """Every (row, position) is read at a packed column whose visible keys are exactly that row's positions
    0 … t, one each, with its tokens, and whose predecessor in the packed row is its position t − 1."""
    B, T = ids.shape
    assert torch.equal(p.unpack(p.input_ids), ids * attn)
    C = p.input_ids.shape[1]
    col = torch.full((B * T,), -1, dtype=torch.long)
    col[p.index] = p.src
    for b in range(B):
        for t in range(int(attn[b].sum())):
            q = int(col[b * T + t])
            r, c = divmod(q, C)
            keys = p.attention[r, 0, c].nonzero().flatten()
            seen = sorted((int(p.position_ids[r, k]), int(p.input_ids[r, k])) for k in keys)
            assert seen == [(s, int(ids[b, s])) for s in range(t + 1)], (b, t)
            if t:
                assert int(p.position_ids[r, c - 1]) == t - 1 and int(p.input_ids[r, c - 1]) == int(
                    ids[b, t - 1]
                )


def test_prefix_tree_layout_and_invariants():
    ids, attn, loss = tree_rows(5000)  # a vocabulary large enough that no own tokens coincide
    p = pack_shared(ids, attn, loss)
    assert p is not None and torch.equal(p.unpack(p.loss_mask), loss)
    assert_tree_invariants(p, ids, attn)
    total = int(attn.sum())
    # read once: the system prompt (60) for five rows, A's prompt (5) for three, A's shared turn (7) for two,
    # B's prompt (6) for two
    assert p.input_ids.shape[0] == 2 and len(set(p.src.tolist())) == total - (60 * 4 + 5 * 2 + 7 + 6)
    # a short system prompt is not worth one long row: the layout then shares within questions only
    short = pack_shared(*tree_rows(5000, system_n=12)[:2], tree_rows(5000, system_n=12)[2])
    assert short is not None and short.input_ids.numel() <= 147


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prefix_tree_invariants_on_random_trees(data):
    """Random rows grown as a tree (each row branches off an earlier one at a random point, or starts anew),
    random lengths and a random order: the packing's reads and masks keep every row's own causal view."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    rows: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 9))):
        if rows and data.draw(st.booleans()):
            base = rows[data.draw(st.integers(0, len(rows) - 1))]
            cut = data.draw(st.integers(0, len(base)))
            rows.append(
                base[:cut] + torch.randint(3, 9, (data.draw(st.integers(1, 12)),), generator=g).tolist()
            )
        else:
            rows.append(torch.randint(3, 9, (data.draw(st.integers(1, 20)),), generator=g).tolist())
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    p = pack_shared(ids, attn, attn.float())
    if p is not None:
        assert_tree_invariants(p, ids, attn)


@pytest.mark.parametrize("kind", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_prefix_tree_equals_padded(tiny_model_dir, lora, kind):
    """Shared trained tokens (a branched episode's first action) included: log-probs, values and gradients of
    the tree-packed batch equal the padded batch's."""
    model = PolicyWithValue(_load(tiny_model_dir, lora))
    lm = model.lm.get_base_model() if lora else model.lm
    lm.config._attn_implementation = kind
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, attn, loss = tree_rows(model.config.vocab_size, seed=2)
    p = pack_shared(ids, attn, loss)
    mask = attention_for(p.attention, kind, torch.float32)
    (lp0, v0, g0), (lp1, v1, g1) = padded_and_packed(model, ids, attn, loss, p, mask)
    assert (lp0 - lp1).abs().max() < 1e-5 and (v0 - v1).abs().max() < 1e-5
    assert g0.keys() == g1.keys() and g0
    assert max(float((g0[k] - g1[k]).abs().max() / g0[k].abs().max().clamp(min=1e-6)) for k in g0) < 1e-5


def test_prefix_tree_on_qwens_real_vocabulary_with_a_system_prompt(qwen_model_dir, qwen_tok):
    """Chat-format rows at Qwen2.5's vocabulary: one system prompt with a tool schema, two questions, episodes
    of which two share a first tool call and its response: the lean path's log-probs and entropies equal the
    padded batch's, and the system prompt runs once."""
    from transformers import AutoModelForCausalLM

    model = add_lean_head(AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32))
    system = (
        '<|im_start|>system\nYou can call {"name": "search", "parameters": {"query": "string"}}.<|im_end|>\n'
    )
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "Keve"}}\n</tool_call><|im_end|>\n'
    response = "<|im_start|>user\n<tool_response>\nKeve is a 1990 film.\n</tool_response><|im_end|>\n"
    pieces = [
        [
            (system + "<|im_start|>user\nWho directed Keve?<|im_end|>\n", 0),
            (call, 1),
            (response, 0),
            ("<|im_start|>assistant\nAnn Lee<|im_end|>", 1),
        ],
        [
            (system + "<|im_start|>user\nWho directed Keve?<|im_end|>\n", 0),
            (call, 1),
            (response, 0),
            ("<|im_start|>assistant\nBo<|im_end|>", 1),
        ],
        [
            (system + "<|im_start|>user\nWhere was Ann Lee born?<|im_end|>\n", 0),
            ("<|im_start|>assistant\nParis<|im_end|>", 1),
        ],
    ]
    rows, masks = [], []
    for row in pieces:
        toks = [qwen_tok(text, add_special_tokens=False)["input_ids"] for text, _ in row]
        rows.append([t for x in toks for t in x])
        masks.append([m for x, (_, m) in zip(toks, row) for _ in x])
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    loss = torch.tensor([m + [0] * (T - len(m)) for m in masks]).float()
    p = pack_shared(ids, attn, loss)
    assert p is not None and p.input_ids.shape[0] == 1
    assert_tree_invariants(p, ids, attn)
    n_system = len(qwen_tok(system, add_special_tokens=False)["input_ids"])
    assert (
        len(set(p.src.tolist())) <= int(attn.sum()) - 2 * n_system
    )  # the system prompt once, not three times
    mask = attention_for(p.attention, "sdpa", torch.float32)
    lp0, e0, _ = forward_lean(model, ids, attn, loss, 1.0, entropy=True)
    lp1, e1, _ = forward_lean(
        model, p.input_ids, mask, p.loss_mask, 1.0, entropy=True, position_ids=p.position_ids
    )
    assert (lp0 - p.unpack(lp1)).abs().max() < 1e-5 and (e0 - p.unpack(e1)).abs().max() < 1e-5
