"""Realistic shapes on a CPU: Qwen2.5-0.5B's configuration with random weights and Qwen2.5's tokenizer.

    python benchmarks/real_shapes.py [--out-model DIR] [--layouts single zero3] [--modes lora full]

Builds the model once (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4,864, vocab 151,936, tied
embeddings; 494M parameters, 2 GB in float32), then runs `gpu_smoke.py` on it for SFT, GRPO and PPO with HF
generation, in one process and under ZeRO-3 with 2 CPU processes, LoRA and full: one or two steps each, the
invariants checked, seconds per step and peak memory per process reported. The vLLM-CPU generation and
weight sync at this shape is tests/rollout/test_vllm.py (run by .ci/vllm).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-model", default="runs/qwen2.5-0.5b-shape", help="where the model is built (kept)")
    p.add_argument("--layouts", nargs="+", default=["single", "zero3"])
    p.add_argument("--modes", nargs="+", default=["lora", "full"])
    p.add_argument("--algorithms", nargs="+", default=["sft", "grpo", "ppo"])
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    model = Path(a.out_model)
    if not (model / "config.json").exists():
        from searchrl.models.tiny import build_local_model

        build_local_model("qwen2.5-0.5b", [], model, tokenizer="qwen2.5")
        print(f"built the Qwen2.5-0.5B-shape model in {model}")
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_smoke.py"),
        "--model",
        str(model),
        "--device",
        "cpu",
        "--algorithms",
        *a.algorithms,
        "--layouts",
        *a.layouts,
        "--modes",
        *a.modes,
        "--backends",
        "hf",
        "--steps",
        str(a.steps),
        "--questions",
        "1",
        "--micro-batch",
        "2",
        "--max-new-tokens",
        "24",
        "--max-total-tokens",
        "384",
        "--tag",
        "real_shapes",
    ]
    raise SystemExit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
