"""Test doubles shared by several test modules."""

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from searchrl.rollout.generator import Generation
from searchrl.rollout.loop import encode


class ScriptedCandidates:
    """A generator whose c-th call answers row j with ``texts[c][j % len(texts[c])]`` (the last call's texts
    repeat), tokenized as the tokenizer would: scripted candidate actions per step."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, texts, 0
        self.prompts = []  # the prompts of every call

    def release(self, cache_keys=None):
        pass

    def generate(self, prompts, params, cache_keys=None):
        row = self.texts[min(self.calls, len(self.texts) - 1)]
        self.prompts.append([list(p) for p in prompts])
        self.calls += 1
        out = []
        for j in range(len(prompts)):
            ids = encode(self.tok, row[j % len(row)])
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


class JSONHandler(BaseHTTPRequestHandler):
    """A scripted stand-in server's handler base: quiet logs, JSON replies and request bodies."""

    def log_message(self, fmt, *args):  # quiet
        pass

    def reply(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self):
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))


QUICKSTART = Path(__file__).resolve().parents[1] / "experiments" / "quickstart.yaml"


def tiny_overrides(world_dir: Path, model_dir: Path, out: Path) -> list[str]:
    """An experiment on the tests' small world and tiny model, writing into ``out`` (`make_exp`'s)."""
    return [
        f"data.world_dir={world_dir}",
        f"model.path={model_dir}",
        f"output_dir={out}",
        "env.template=short",
        "env.topk=2",
        "env.max_turns=3",
        "rollout.max_new_tokens=16",
        "rollout.max_total_tokens=256",
        "rewards=[{name: f1}]",
    ]


def eval_teacher(out: Path, *overrides: str) -> None:
    """`searchrl eval experiments/quickstart.yaml --agent teacher` into ``out``, with ``overrides``."""
    from searchrl.app.cli import main

    main(["eval", str(QUICKSTART), "--agent", "teacher", f"output_dir={out}", *overrides])


def qwen_model():
    """A random Qwen2 model (seed 2) with all 151,936 output rows of Qwen2.5's vocabulary, 2 small layers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=[151645, 151643],
    )
    return Qwen2ForCausalLM(cfg).eval()


def gpu_only() -> list:
    """The marks of a test module that runs on a CUDA GPU only, in float32 without TF32."""
    import pytest
    import torch

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        pytest.mark.usefixtures("no_tf32"),  # tests/conftest.py
    ]
