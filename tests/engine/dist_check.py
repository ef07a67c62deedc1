"""One training step under whatever `accelerate launch` set up; writes the loss and the updated weights.

Run directly for 1 process, or with `accelerate launch --config_file ...` for 2. The rollouts are made
identically on every process (same seed, the whole step's questions), then each process keeps its own
groups, so any difference between layouts comes from the engine, not from sampling.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from searchrl.config import TrainerConfig, load_experiment
from searchrl.engine.trainer import Trainer
from searchrl.envs.synthetic.teacher import TeacherConfig, teacher_records
from searchrl.rewards import register_reward
from searchrl.rollout.loop import rollout
from searchrl.runtime import Runtime


@register_reward("dist_check_ids")
def ids_reward(traj, **_):
    ids = [i for seg in traj.segments if seg.kind == "action" for i in seg.token_ids]
    return (sum(ids) % 7) / 6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", default="grpo")
    p.add_argument("--world", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lora", action="store_true")
    a = p.parse_args()
    overrides = [f"data.world_dir={a.world}", f"model.path={a.model}", f"output_dir={Path(a.out).parent / 'run'}",
                 "env.template=short", "env.topk=2", "env.max_turns=2", "rollout.max_new_tokens=8",
                 "rollout.max_total_tokens=160", "rollout.group_size=4", "rollout.temperature=1.0",
                 "rewards=[{name: dist_check_ids}]"]  # fmt: skip
    if a.lora:
        overrides.append("model.lora={r: 4, alpha: 8}")
    exp = load_experiment(None, overrides)
    rt = Runtime(exp)
    cfg = TrainerConfig(steps=1, batch_size=4, micro_batch_size=4, lr=0.5, optimizer="sgd", save_every=1000,
                        max_grad_norm=1e9, log_entropy=False)  # fmt: skip
    records = None
    if a.algorithm == "sft":
        records = teacher_records(rt.env(), rt.world, rt.examples("train")[:8], TeacherConfig())
    online = a.algorithm in ("grpo", "ppo")
    args = {"kl_coef": float(os.environ.get("DIST_KL", "0.1"))} if online else {}
    tr = Trainer(algorithm=a.algorithm, algorithm_args=args,
                 model_path=a.model, cfg=cfg, out_dir=Path(a.out).parent / "run", runtime=rt, records=records)  # fmt: skip
    eng = tr.engine
    if online:
        ctx = tr.ctx

        def collect(indices):
            everything = tr.schedule.indices(0)
            torch.manual_seed(1234)
            examples = [ctx.train_examples[i] for i in everything]
            trajs, _ = rollout(examples, ctx.env, ctx.generator, ctx.tokenizer, ctx.sampling, ctx.group_size,
                               ctx.max_total_tokens)  # fmt: skip
            mine = [t for t in trajs if t.group_id % eng.world_size == eng.rank]
            return mine, ctx.rewards(mine)

        tr.algo.collect = collect
    metrics = tr.step(0)
    if os.environ.get("DIST_DEBUG"):
        print(
            "RANK",
            eng.rank,
            {k: round(v, 6) for k, v in metrics.items() if not k.startswith("time")},
            flush=True,
        )
    state = eng.accelerator.get_state_dict(tr.policy)
    if eng.is_main:
        torch.save({"loss": metrics["train/loss"], "world": eng.world_size, "deepspeed": eng.is_deepspeed,
                    "step_s": metrics["time/step_s"],
                    "state": {k: v.float().cpu() for k, v in state.items()}}, a.out)  # fmt: skip
    eng.wait()


if __name__ == "__main__":
    main()
