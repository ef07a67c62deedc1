"""DeepSpeed ZeRO-3 overhead against DDP for the same GRPO step, on 2 CPU processes (tiny model).

    python benchmarks/zero3_overhead.py --world WORLD_DIR --model MODEL_DIR [--repeats 3]

Runs tests/engine/dist_e2e.py (case grpo, or grpo-lora: GRPO steps with real rollouts, each process on its
own questions) under each accelerate config and reports the first step's time (rollout + log-prob passes +
update, the slower process). CPU only: GPU numbers need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "tests" / "engine" / "dist_e2e.py"
CONFIGS = {"ddp": ("cpu_ddp.yaml", {"ACCELERATE_USE_CPU": "1"}), "zero3": ("cpu_zero3.yaml", {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args()
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    res: dict[str, list[float]] = {}
    for name, (cfg, extra) in CONFIGS.items():
        for _ in range(a.repeats):
            out = Path(tempfile.mkdtemp())
            case = "grpo-lora" if a.lora else "grpo"
            env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {
                "OMP_NUM_THREADS": "1",
                **extra,
            }
            cmd = [
                accelerate,
                "launch",
                "--config_file",
                str(REPO / "experiments" / "accelerate" / cfg),
                "--main_process_port",
                "0",
                str(CHECK),
                "--world",
                a.world,
                "--model",
                a.model,
                "--out",
                str(out),
                "--case",
                case,
            ]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            logged = pickle.loads((out / case / "rank0.pkl").read_bytes())["logged"]
            res.setdefault(name, []).append(logged[0]["time/step_s"])
    mean = {k: statistics.mean(v) for k, v in res.items()}
    print("| setup | seconds per GRPO step (2 CPU processes) | runs |\n|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {mean[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    print(f"ZeRO-3 / DDP = {mean['zero3'] / mean['ddp']:.2f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"zero3_overhead{'-lora' if a.lora else ''}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
