"""Our own calls into transformers, torch and trl use their current names: a short quickstart with every
FutureWarning and DeprecationWarning turned into an error runs clean (transformers 5.24 renamed the KV-cache
argument and the activation-checkpointing methods; the old names go in 5.40 and v6). Deprecations inside
dependencies that users cannot act on are filtered by name in `searchrl.engine.engine`."""

import subprocess
import sys
import warnings
from pathlib import Path

import torch

from searchrl.rollout.hf import cache_kwargs, output_cache

REPO = Path(__file__).resolve().parents[1]


def test_a_short_quickstart_raises_no_deprecation(tmp_path):
    cmd = [
        sys.executable,
        "-W",
        "error::FutureWarning",
        "-W",
        "error::DeprecationWarning",
        "-m",
        "searchrl",
        "train",
        str(REPO / "experiments" / "quickstart.yaml"),
        "warm_start.teacher_passes=1",
        "warm_start.trainer.steps=3",
        "warm_start.trainer.eval_limit=4",
        "trainer.steps=2",
        "trainer.batch_size=4",
        "trainer.eval_limit=4",
        "eval.limit=4",
        f"output_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]
    assert (tmp_path / "run" / "results.json").exists()


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=True): ...


class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=True): ...


def test_the_cache_goes_under_the_name_the_forward_takes():
    cache = object()
    assert cache_kwargs(_New(), cache) == {"cache": cache}
    assert cache_kwargs(_Old(), cache) == {"past_key_values": cache}

    class Peft:  # a peft wrapper: its base model's forward decides
        def get_base_model(self):
            return _New()

    assert cache_kwargs(Peft(), cache) == {"cache": cache}
    from searchrl.models.policy import PolicyWithValue

    class Lm(_New):
        config = type("C", (), {"hidden_size": 4})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    wrapped = PolicyWithValue(Lm())  # PPO's policy and value head: its forward takes **kwargs
    assert cache_kwargs(wrapped, cache) == {"cache": cache}
    assert output_cache(type("Out", (), {"cache": cache})()) is cache
    assert output_cache(type("Out", (), {"past_key_values": cache})()) is cache


def test_the_installed_transformers_takes_the_name_we_pass():
    """Against the installed transformers (the oldest admitted in CI's second leg, the newest in .ci/latest):
    the cache passed is used, and passing it warns of nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        first = model(input_ids=ids[:, :2], use_cache=True)
        step = model(input_ids=ids[:, 2:], use_cache=True, **cache_kwargs(model, output_cache(first)))
        whole = model(input_ids=ids, use_cache=False)
    assert torch.allclose(step.logits[0, -1], whole.logits[0, -1], atol=1e-5)  # the cache was used
