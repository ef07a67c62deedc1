"""Lean log-probs (`models.lean_head`: the output layer applied only at action tokens, in tiles, inside the
model's forward) equal the full-logits path: values, entropy and gradients; Qwen2 and Llama, tied and
untied output layers, LoRA, the value head; generation unchanged. (Under ZeRO-3 and DDP:
tests/engine/test_distributed.py, case grpo-full-logits.)"""

import pytest
import torch
import torch.nn.functional as F

from searchrl.core.config import TrainerConfig
from searchrl.core.functional import token_entropy, token_logprobs
from searchrl.models.lean_head import add_lean_head
from searchrl.models.policy import PolicyWithValue, forward, forward_lean

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


def random_batch(V: int, B: int = 3, T: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, 8:] = 0  # right padding
    mask = (torch.rand(B, T, generator=g) > 0.4).float() * attention
    mask[:, 0] = 0
    return ids, attention, mask


def llama(V: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return add_lean_head(LlamaForCausalLM(cfg))


def qwen(V: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return add_lean_head(Qwen2ForCausalLM(cfg))


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )


@pytest.mark.parametrize(
    "build",
    ["qwen", "llama", "qwen-lora", "qwen-value-head", "qwen-tiled", "llama-tiled", "qwen-large-vocab"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lean_equals_full_with_gradients(build, temperature, monkeypatch):
    """Both ways the output layer runs: whole (a small vocabulary x positions, `direct_logprobs`) and in
    TRL's tiles (``-tiled``, and a vocabulary of several tiles)."""
    V = 20000 if build == "qwen-large-vocab" else 300
    if build == "qwen-large-vocab":  # several vocabulary tiles
        monkeypatch.setattr("searchrl.models.lean_head.VOCAB_TILE", 4096)
    if build.endswith("-tiled") or build == "qwen-large-vocab":
        monkeypatch.setattr("searchrl.models.lean_head.DIRECT_LIMIT", 0)
        build = build.removesuffix("-tiled")
    model = {
        "qwen": qwen,
        "llama": llama,
        "qwen-lora": lambda v: with_lora(qwen(v)),
        "qwen-value-head": lambda v: PolicyWithValue(qwen(v)),
        "qwen-large-vocab": qwen,
    }[build](V)
    values = build == "qwen-value-head"
    if values:
        torch.nn.init.normal_(model.value_head.weight)
    ids, attention, mask = random_batch(V)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(lean: bool):
        model.zero_grad()
        if lean:
            lp, ent, v = forward_lean(model, ids, attention, mask, temperature, entropy=True, values=values)
        else:
            logits, v = forward(model, ids, attention, values=values)
            lp = token_logprobs(logits, ids, temperature, mask=mask)
            ent = token_entropy(logits.detach() / temperature, mask)
        loss = (lp * mask * torch.linspace(-1, 2, lp.shape[1])).sum() + (
            0.0 if v is None else (v * mask).sum()
        )
        loss.backward()
        return lp.detach(), ent, v, [p.grad.clone() for p in params]

    lp_l, ent_l, v_l, g_l = run(True)
    lp_f, ent_f, v_f, g_f = run(False)
    assert torch.allclose(lp_l, lp_f, atol=1e-5) and torch.allclose(ent_l, ent_f, atol=1e-5)
    assert (v_l is None) == (v_f is None) and (v_l is None or torch.allclose(v_l, v_f, atol=1e-5))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_l, g_f))


def test_generation_is_unchanged_by_the_patch():
    ids = torch.randint(0, 300, (2, 5))
    plain = qwen(300)
    plain.forward = type(plain).forward.__get__(plain)  # the original forward
    patched = qwen(300)
    a = plain.generate(ids, max_new_tokens=6, do_sample=False)
    b = patched.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_a_copy_of_a_patched_model_runs_its_own_weights():
    """The asynchronous worker samples with a deep copy of the policy: the copy's forward, plain and lean,
    must use the copy's weights (a patch that called the original model's bound forward ran the trainer's)."""
    import copy

    model = qwen(300)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 300, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain, copied = model(input_ids=ids).logits, twin(input_ids=ids).logits
        ref = type(twin).forward(twin, input_ids=ids).logits  # the class's forward on the copy's weights
        lean = twin(input_ids=ids, lean_mask=mask).logprobs
    assert torch.equal(copied, ref) and not torch.allclose(copied, plain)
    assert torch.allclose(lean, token_logprobs(ref, ids) * F.pad(mask[:, 1:], (1, 0)), atol=1e-5)


def test_trainer_defaults_to_the_lean_path():
    assert TrainerConfig().lean_logprobs is True


def test_sampled_softmax_is_exact_when_every_other_row_is_drawn():
    from searchrl.models.lean_head import sampled_logprobs

    torch.manual_seed(4)
    head = torch.nn.Linear(8, 50, bias=False)
    ids = torch.randint(0, 50, (2, 6))
    hidden = torch.randn(5, 8)
    targets = ids.flatten()[:5]
    exact = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(sampled_logprobs(hidden, head, ids, targets, negatives=10**6), exact, atol=1e-6)


def test_sampled_softmax_estimates_the_normaliser_without_bias():
    """Averaged over draws, the sampled sum of exp-logits equals the exact normaliser."""
    from searchrl.models.lean_head import sampled_logprobs

    torch.manual_seed(5)
    head = torch.nn.Linear(8, 400, bias=False)
    ids = torch.randint(0, 400, (1, 10))
    hidden, targets = torch.randn(3, 8), ids[0, :3]
    exact = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    # log p = l_t - log Ẑ, so exp(l_t - log p) = Ẑ: average Ẑ over draws
    z_hat = torch.stack(
        [torch.exp(-sampled_logprobs(hidden, head, ids, targets, negatives=40)) for _ in range(3000)]
    ).mean(0)
    assert torch.allclose(z_hat, torch.exp(-exact), rtol=0.02)


def test_sft_with_a_sampled_softmax_lowers_the_exact_loss(make_exp, small_world):
    from searchrl.app.resources import Resources
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import teacher_records
    from tests.engine.test_trainer import trainer_for

    exp = make_exp()
    resources = Resources(exp)
    recs = teacher_records(resources.env(), small_world, small_world.examples("train")[:32], TeacherConfig())
    cfg = TrainerConfig(steps=6, batch_size=8, micro_batch_size=8, lr=3e-3, save_every=100)
    tr = trainer_for(exp, "sft", cfg, records=recs, args={"sampled_softmax": 64})
    from searchrl.core.masking import build_batch

    batch = build_batch(tr.algo.trajs[:8], tr.tokenizer.pad_token_id)

    def exact_nll() -> float:
        with torch.no_grad():
            lp = forward_lean(tr.policy, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0)[0]
        return float(-(lp * batch.loss_mask).sum() / batch.loss_mask.sum())

    before = exact_nll()
    tr.run()
    assert exact_nll() < before - 0.5  # 7.67 -> 6.13 on one CPU: the margin is three times the bound
