"""`model.gradient_checkpointing`: the layers' activations are recomputed in the backward pass (each decoder
layer runs twice per training forward-backward), the gradients are those without it, and generation and
no-grad passes run once, as before. Full, LoRA and the value head; and a trainer step with it on."""

import math

import pytest
import torch

from searchrl.core.config import LoraConfig
from searchrl.models.policy import forward_lean, lm_of, load_policy

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics


def layer_calls(model) -> list[int]:
    base = lm_of(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    calls = [0]
    # a submodule of the layer: its hooks fire in the recomputation whether transformers checkpoints the layer's
    # __call__ (before 5.2x) or its forward
    base.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("mode", ["full", "lora", "value-head"])
def test_checkpointing_recomputes_and_keeps_the_gradients(tiny_model_dir, mode):
    lora = LoraConfig(r=4, alpha=8, dropout=0.0) if mode == "lora" else None
    values = mode == "value-head"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 12), generator=g)
    attention = torch.ones_like(ids)
    mask = torch.zeros(2, 12)
    mask[:, 6:] = 1.0

    def run(checkpointing: bool):
        torch.manual_seed(0)  # the same LoRA initialisation both times
        model, _ = load_policy(
            str(tiny_model_dir), lora=lora, value_head=values, gradient_checkpointing=checkpointing
        )
        if lora is not None:  # B = 0 at initialisation: give the adapter a non-zero gradient path
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.02)
        model.train()
        calls = layer_calls(model)
        lp, _, v = forward_lean(model, ids, attention, mask, 1.0, values=values)
        loss = (lp * mask).sum() + (0.0 if v is None else (v * mask).sum())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        trained = calls[0]
        with torch.no_grad():
            forward_lean(model, ids, attention, mask, 1.0)
        return lp.detach(), grads, trained, calls[0] - trained

    lp0, g0, trained0, nograd0 = run(False)
    lp1, g1, trained1, nograd1 = run(True)
    assert (trained0, trained1) == (1, 2)  # the layer ran again in the backward pass
    assert nograd0 == nograd1 == 1  # a no-grad pass is not checkpointed
    assert torch.allclose(lp0, lp1, atol=1e-6)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), n


def test_generation_with_checkpointing_is_unchanged(tiny_model_dir):
    from searchrl.rollout.generator import SamplingParams
    from searchrl.rollout.hf import HFGenerator

    outs = []
    for checkpointing in (False, True):
        model, tok = load_policy(str(tiny_model_dir), gradient_checkpointing=checkpointing)
        model.train()  # as between training steps: the generator switches to eval mode (KV cache) itself
        gen = HFGenerator(model, tok, (), batch_size=2)
        torch.manual_seed(1)
        outs.append([o.token_ids for o in gen.generate([[5, 6, 7], [8, 9]], SamplingParams(1.0, 1.0, 8))])
        assert model.training
    assert outs[0] == outs[1]


def make_trainer(make_exp, tmp_path, algorithm: str, *overrides: str):
    from searchrl.algorithms import algorithm_config
    from searchrl.app.resources import Resources
    from searchrl.core.config import SamplesConfig, TrainerConfig
    from searchrl.engine.trainer import Trainer

    exp = make_exp("model.gradient_checkpointing=true", *overrides)
    cfg = TrainerConfig(
        steps=1, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=10**6, samples=SamplesConfig(groups=0)
    )
    return Trainer(
        algorithm=algorithm,
        config=algorithm_config(algorithm, {"group_size": 2}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=tmp_path / "out",
        resources=Resources(exp),
        seed=0,
    )


def test_a_grpo_step_with_checkpointing_and_lora(make_exp, tmp_path):
    tr = make_trainer(make_exp, tmp_path, "grpo", "model.lora={r: 4, alpha: 8}")
    assert lm_of(tr.engine.unwrap(tr.policy)).is_gradient_checkpointing
    m = tr.step(0)
    assert all(math.isfinite(v) for k, v in m.items() if k.startswith("train/"))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_checkpointing_stays_on_and_non_reentrant_across_a_step(make_exp, tmp_path, algorithm):
    """trl's generation helper turns checkpointing off for the rollout and back on after, through the value
    head's wrapper for PPO: it is on again after the step, with our arguments."""
    tr = make_trainer(make_exp, tmp_path, algorithm)
    tr.step(0)
    layer = lm_of(tr.engine.unwrap(tr.policy)).model.layers[0]
    assert layer.gradient_checkpointing
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
