"""Every algorithm for a few steps on real rollouts under whatever `accelerate launch` set up.

Each process trains on its own questions with its own rollouts (they differ in turns, finish reasons and
lengths), as in a real run. Per case, each process writes what it collected at the first step, its
generation-call counts and the metrics it logged; the main process also writes the weights after the
first step. The test (test_distributed.py) checks that the processes logged identical metrics, that
their rollouts really differed, and that the metrics and weights equal what one process computes from the
union of their data. The GRPO case also evaluates during training, checkpoints, and resumes.

Run: ``accelerate launch --config_file CFG dist_e2e.py --world W --model M --out DIR [--case NAME ...]``.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from searchrl.rewards import REWARDS, register_reward  # noqa: E402
from searchrl.rewards.judges import JUDGES  # noqa: E402

TIME_KEYS = ("time/", "mem/", "rollout/tokens_per_second")  # wall-clock times, memory: differ between runs


def ids_reward(traj: Any, **_: Any) -> float:
    """Varies between samples of one group even for a barely trained model, so every algorithm has signal."""
    ids = [i for seg in traj.segments if seg.kind == "action" for i in seg.token_ids]
    return (sum(ids) % 7) / 6


class TextJudge:
    """SLATE's judge for these runs: the rule judge plus a think score that varies with the action's text,
    so a barely trained model (every step malformed to the rule judge) still gives step advantages."""

    def __init__(self) -> None:
        from searchrl.rewards.judges import RuleJudge

        self.rule = RuleJudge()

    def __call__(self, items: Any) -> list[Any]:
        from dataclasses import replace

        return [
            replace(s, think=s.think + sum(map(ord, it.action)) % 7 / 6)
            for s, it in zip(self.rule(items), items)
        ]


if "dist_e2e_ids" not in REWARDS:
    register_reward("dist_e2e_ids")(ids_reward)
if "dist_e2e_text" not in JUDGES:
    JUDGES.add("dist_e2e_text", TextJudge)

ONLINE = (
    "grpo",
    "grpo-full-logits",
    "grpo-packed",
    "grpo-balanced",
    "grpo-lora",
    "grpo-lora-packed",
    "grpo-prefix-cache",
    "grpo-lora-packed-prefix-cache",
    "grpo-checkpointing",
    "ppo",
    "ppo-lora",
    "steppo",
    "slate",
    "grpo-async",
    "grpo-lora-async",
)
ASYNC = {"max_staleness": 1}
CASES: dict[str, dict[str, Any]] = {
    "grpo": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}},
    "grpo-full-logits": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}, "lean": False},
    "grpo-packed": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}, "packing": True},
    # whole groups moved between the processes to even out their tokens (`trainer.balance_ranks`)
    "grpo-balanced": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}, "balance": True},
    "grpo-lora": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}, "lora": True},
    # packed with shared prefixes (a group's prompt once; `models.prefix`), under LoRA
    "grpo-lora-packed": {
        "algorithm": "grpo",
        "args": {"group_size": 2, "kl_coef": 0.05},
        "lora": True,
        "packing": True,
    },
    # every micro-batch's common prompt run once, its keys and values reused by the rows (`models.prefix_cache`):
    # padded and full; packed as a prefix tree under LoRA (two passes through the layers before one backward,
    # which under ZeRO-3 gathers each layer's parameters twice)
    "grpo-prefix-cache": {"algorithm": "grpo", "args": {"group_size": 2, "kl_coef": 0.05}, "prefix_cache": 2},
    "grpo-lora-packed-prefix-cache": {
        "algorithm": "grpo",
        "args": {"group_size": 2, "kl_coef": 0.05},
        "lora": True,
        "packing": True,
        "prefix_cache": 2,
    },
    # activations recomputed in the backward pass (`model.gradient_checkpointing`; under ZeRO-3 the recompute
    # gathers each layer's parameters again)
    "grpo-checkpointing": {
        "algorithm": "grpo",
        "args": {"group_size": 2, "kl_coef": 0.05},
        "checkpointing": True,
    },
    "ppo": {
        "algorithm": "ppo",
        "args": {"group_size": 2, "kl_coef": 0.05, "adaptive_kl": True, "kl_horizon": 100},
        "schedule": "cosine",
    },
    "ppo-lora": {"algorithm": "ppo", "args": {"group_size": 2, "kl_coef": 0.05}, "lora": True},
    "steppo": {
        "algorithm": "steppo",
        "args": {"group_size": 2, "kl_coef": 0.0},
        "rewards": "[{name: stepsearch}, {name: dist_e2e_ids}]",
    },
    "slate": {"algorithm": "slate", "args": {"k": 2, "kl_coef": 0.05, "judge": "dist_e2e_text"}},
    # asynchronous rollouts: each process's worker samples its share on a whole copy of the policy, filled
    # from the trainer's parameters after every step (under ZeRO-3 gathered; with LoRA the adapter only)
    "grpo-async": {
        "algorithm": "grpo",
        "args": {"group_size": 2, "kl_coef": 0.05, "rollout_correction": {"mode": "token_tis"}},
        "async": True,
    },
    "grpo-lora-async": {
        "algorithm": "grpo",
        "args": {"group_size": 2, "kl_coef": 0.05, "rollout_correction": {"mode": "token_tis"}},
        "async": True,
        "lora": True,
    },
    "sft": {"algorithm": "sft", "args": {}, "schedule": "cosine"},  # the warm start's schedule
    "dpo": {"algorithm": "dpo", "args": {"beta": 0.5}, "schedule": "wsd"},
    "prm": {"algorithm": "prm", "args": {}},
}
BATCH = 4  # questions (online) or records (offline) per step over all processes


def overrides(world: str, model: str, out: Path, case: str) -> list[str]:
    spec = CASES[case]
    over = [
        f"data.world_dir={world}",
        f"model.path={model}",
        f"output_dir={out}",
        "env.template=short",
        "env.topk=2",
        "env.max_turns=3",
        "rollout.max_new_tokens=32",
        "rollout.max_total_tokens=320",
        "rollout.temperature=1.0",
        f"rewards={spec.get('rewards', '[{name: f1}, {name: dist_e2e_ids}]')}",
    ]
    if spec.get("lora"):
        over.append("model.lora={r: 4, alpha: 8}")
    if spec.get("checkpointing"):
        over.append("model.gradient_checkpointing=true")
    return over


def trainer_config(
    steps: int = 3,
    lean: bool = True,
    packing: bool = False,
    balance: bool = False,
    max_staleness: int = 0,
    schedule: str = "linear",
    prefix_cache: int | None = None,
) -> Any:
    """Plain SGD without clipping, so that the update is the gradient itself and a wrong gradient shows
    in the weights (Adam's first step would hide its scale). A decaying schedule without warm-up: the first
    step runs at the full rate, the next ones show whether the schedule advanced once per step."""
    from searchrl.core.config import AsyncRolloutConfig, TrainerConfig

    return TrainerConfig(
        schedule=schedule,  # type: ignore[arg-type]
        decay_fraction=0.5 if schedule == "wsd" else 0.0,
        steps=steps,
        batch_size=BATCH,
        micro_batch_size=4,
        lr=0.05,
        optimizer="sgd",
        max_grad_norm=1e9,
        save_every=10**6,
        lean_logprobs=lean,
        packing=packing,
        balance_ranks=balance,
        prefix_cache_tokens=prefix_cache,
        log_entropy=True,
        async_rollout=AsyncRolloutConfig(max_staleness=max_staleness),
    )


def records(resources: Any, case: str) -> list[dict[str, Any]] | None:
    """Offline data: teacher trajectories (SFT), or step pairs built from them (DPO, PRM): the state
    before a teacher action, that action as chosen and a malformed search as rejected."""
    from searchrl.core.config import TeacherConfig
    from searchrl.envs.synthetic.teacher import teacher_records

    if case not in ("sft", "dpo", "prm"):
        return None
    recs = teacher_records(
        resources.env(), resources.world, resources.examples("train")[:24], TeacherConfig()
    )
    if case == "sft":
        return recs
    pairs = []
    for r in recs:
        for k, action in enumerate(r["actions"]):
            pairs.append(
                {
                    "prompt": r["prompt"],
                    "actions": r["actions"][:k],
                    "observations": r["observations"][:k],
                    "chosen": action,
                    "rejected": "<think> hmm </think>\n<search> zzz qqq </search>" * (1 + k % 2),
                }
            )
    return pairs


def build(
    world: str, model: str, out: Path, case: str, steps: int = 3, resume: bool = False, sync: bool = False
) -> Any:
    """The case's trainer; ``sync``: with synchronous rollouts even where the case is asynchronous (to
    replay given episodes in one process)."""
    from searchrl.algorithms import algorithm_config
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.engine.trainer import Trainer

    exp = load_experiment(None, overrides(world, model, out, case))
    resources = Resources(exp)
    spec = CASES[case]
    tr = Trainer(
        algorithm=spec["algorithm"],
        config=algorithm_config(spec["algorithm"], spec["args"]),
        model_path=model,
        cfg=trainer_config(
            steps,
            spec.get("lean", True),
            spec.get("packing", False),
            spec.get("balance", False),
            ASYNC["max_staleness"] if spec.get("async") and not sync else 0,
            spec.get("schedule", "linear"),
            spec.get("prefix_cache"),
        ),
        out_dir=out,
        resources=resources,
        records=records(resources, case),
        resume=resume,
        seed=0,
    )
    return tr, resources


def checkpointing(model: Any) -> bool:
    from searchrl.models.policy import is_peft, lm_of

    lm = lm_of(model)
    base = lm.get_base_model() if is_peft(lm) else lm
    return bool(base.model.layers[0].gradient_checkpointing)


def instrument(tr: Any) -> dict[str, list[Any]]:
    """Record what this process collected and how many generation calls each step made."""
    seen: dict[str, list[Any]] = {"collected": [], "gen_calls": []}
    collect = tr.algo.collect
    gen = tr.ctx.generator
    calls = [0]
    if gen is not None:  # turns of the turn loop, or decode steps of the continuous batch
        generate, stream = gen.generate, getattr(gen, "stream", None)

        def counted(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            return generate(*a, **kw)

        @contextmanager
        def counted_stream(*a: Any, **kw: Any) -> Iterator[Any]:
            assert stream is not None
            with stream(*a, **kw) as s:
                step = s.step

                def counted_step() -> Any:
                    calls[0] += 1
                    return step()

                s.step = counted_step
                yield s

        gen.generate = counted
        if stream is not None:
            gen.stream = counted_stream

    def recorded(indices: list[int]) -> Any:
        calls[0] = 0
        trajs, metrics = collect(indices)
        seen["collected"].append(trajs)
        seen["gen_calls"].append(calls[0])
        return trajs, metrics

    tr.algo.collect = recorded
    if tr.cfg.async_rollout.max_staleness:  # the worker's episodes, as the trainer takes them
        take = tr.rollouts.collect

        def taken(step: int, indices: list[int]) -> Any:
            trajs, metrics = take(step, indices)
            seen["collected"].append(trajs)
            seen["gen_calls"].append(0)
            return trajs, metrics

        tr.rollouts.collect = taken
    return seen


def worker_state(tr: Any) -> dict[str, Any]:
    """The rollout worker's version and its copy's largest difference from the trainer's weights (gathered
    under ZeRO-3, a collective); then the worker is stopped."""
    from searchrl.engine.worker_weights import gathered

    with gathered(tr.engine, tr.policy) as w:
        theirs = dict(tr.rollouts.worker.model.named_parameters())
        diff = max(float((v.float() - theirs[n].float().to(v.device)).abs().max()) for n, v in w.items())
    out = {
        "worker_version": tr.rollouts.worker.version,
        "worker_max_diff": diff,
        "shipped": list(tr.rollouts.worker.shipped),  # the parameters sent after each step
        "parameters": list(w),
    }
    tr.rollouts.worker.close()
    tr.rollouts.worker = None
    return out


def run_case(world: str, model: str, out_root: Path, case: str) -> None:
    import torch

    out = out_root / case
    tr, resources = build(world, model, out, case)
    eng = tr.engine
    seen = instrument(tr)
    import searchrl.engine.step as step_module

    # each pass's cached prefix (0: none) and its rows' layout: padded (a 2-D mask) or a prefix tree (4-D)
    cached: list[tuple[int, int]] = []
    lean, cost = step_module.forward_lean, step_module.cached_cost

    def recorded_lean(model: Any, ids: Any, attn: Any, *a: Any, prefix: int = 0, **kw: Any) -> Any:
        cached.append((prefix, 0 if attn is None else attn.dim()))
        return lean(model, ids, attn, *a, prefix=prefix, **kw)

    step_module.forward_lean = recorded_lean  # type: ignore[assignment]
    import searchrl.models.prefix as prefix_module

    tree_cost = prefix_module._cost
    if CASES[case].get("packing") and CASES[case].get("prefix_cache"):
        # the prefix tree after the cached prefix, whatever the costs say (these short rows would run plainly
        # packed, or padded after the prefix; padded has its own case): the tree's cost counted in tokens only
        step_module.cached_cost = lambda rows, width, prefix: rows  # type: ignore[assignment]
        prefix_module._cost = lambda n: n  # type: ignore[assignment]
    logged = [tr.step(0)]
    state = eng.accelerator.get_state_dict(tr.policy)  # collective under ZeRO-3
    if eng.is_main:
        torch.save({k: v.float().cpu() for k, v in state.items()}, out / "state-after-step-1.pt")
    logged.append(tr.step(1))
    step_module.cached_cost, step_module.forward_lean = cost, lean  # type: ignore[assignment]
    prefix_module._cost = tree_cost  # type: ignore[assignment]
    result: dict[str, Any] = {
        "rank": eng.rank,
        "world": eng.world_size,
        "deepspeed": eng.is_deepspeed,
        # whether the first decoder layer recomputes its activations, read after two steps (generation turns
        # checkpointing off and back on)
        "checkpointing": checkpointing(eng.unwrap(tr.policy)),
        "logged": logged,
        "gen_calls": seen["gen_calls"],
        "cached_prefixes": cached,
    }
    if case == "grpo":  # evaluation during training (uneven shards), a checkpoint, and a resume from it
        from searchrl.app.train import make_evaluator

        with eng.phase("evaluation", 1):
            result["eval"] = make_evaluator(resources, "dev", 7)(tr, 2)
        tr.ckpt.save(2, {"metrics": logged[-1], "algorithm": tr.algo.state_dict()})
        result["continued"] = tr.step(2)
        resumed, _ = build(world, model, out, case, resume=True)
        result["resumed_from"] = resumed.start_step
        result["resumed"] = resumed.step(2)
    if tr.rollouts.worker is not None:
        result.update(worker_state(tr))
    tr.ckpt.export_model(out / "final")
    eng.wait()
    result["collected"] = seen["collected"][0] if seen["collected"] else None
    with open(out / f"rank{eng.rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    eng.wait()


REDUCE_REPORTS = {  # what each process reports: different keys, as rollouts with different outcomes give
    0: {
        "a/mean": ("mean", 3.0, 2.0),
        "a/sum": ("sum", 5.0),
        "a/max": ("max", 1.5),
        "only0": ("mean", 4.0, 4.0),
        "plain": ("plain", 2.0),
    },
    1: {
        "a/mean": ("mean", 1.0, 6.0),
        "a/sum": ("sum", 7.0),
        "a/max": ("max", 2.5),
        "only1/x": ("sum", 9.0),
        "only1/y": ("max", -1.0),
        "plain": ("plain", 4.0),
    },
}


def report_of(rank: int) -> dict[str, float]:
    from searchrl.core.aggregate import Max, Mean, Sum

    kinds = {"mean": Mean, "sum": Sum, "max": Max, "plain": float}
    return {k: kinds[kind](*vals) for k, (kind, *vals) in REDUCE_REPORTS[rank].items()}


def check_reduce(out: Path) -> None:
    """Processes reporting different metric keys reduce to the same values, without hanging."""
    from searchrl.engine.engine import Engine

    eng = Engine()
    got = eng.reduce_metrics(report_of(eng.rank))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"reduce-rank{eng.rank}.pkl", "wb") as f:
        pickle.dump(got, f)
    eng.wait()


# every schedule, with a warm-up, two micro-batches per update and two updates per step (`trainer.mini_batches`)
SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"schedule": "constant", "warmup_steps": 2},
    "linear": {"schedule": "linear", "warmup_steps": 2},
    "cosine": {"schedule": "cosine", "warmup_steps": 2},
    "wsd": {"schedule": "wsd", "warmup_steps": 2, "decay_fraction": 0.5},
}


def case_learning_rates(case: str, steps: int) -> list[float]:
    """The learning rate after each of the first ``steps`` steps of ``case``'s trainer, on one process."""
    import torch

    from searchrl.engine.schedule import make_optimizer

    cfg = trainer_config(schedule=CASES[case].get("schedule", "linear"))
    opt, sched = make_optimizer(cfg, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    out = []
    for _ in range(steps):
        for _ in range(cfg.epochs * cfg.mini_batches):
            opt.step()
            sched.step()
        out.append(float(sched.get_last_lr()[0]))
    return out


def schedule_config(name: str) -> Any:
    from searchrl.core.config import TrainerConfig

    return TrainerConfig(steps=8, lr=1.0, optimizer="sgd", mini_batches=2, **SCHEDULES[name])


def learning_rates(name: str, engine: Any = None) -> list[float]:
    """The learning rate after each step of ``name``'s schedule: through ``engine``'s prepared optimizer and
    scheduler, stepped as the training step steps them (every micro-batch, inside ``accumulate``), or with no
    engine the torch scheduler alone, stepped once per update (what the schedule means)."""
    import torch

    from searchrl.engine.schedule import make_optimizer

    cfg = schedule_config(name)
    model = torch.nn.Linear(4, 1)
    opt, sched = make_optimizer(cfg, [{"params": list(model.parameters())}])
    if engine is not None:
        model, opt, sched = engine.prepare(model, opt, sched)
    device = next(model.parameters()).device
    out = []
    for _ in range(cfg.steps):
        for _ in range(cfg.epochs * cfg.mini_batches):
            for _ in range(engine.grad_accum if engine is not None else 1):
                if engine is None:
                    opt.step()
                    sched.step()
                    continue
                with engine.accumulate(model):
                    engine.backward(model(torch.ones(1, 4, device=device)).sum())
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        out.append(float(sched.get_last_lr()[0]))
    return out


def check_schedules(out: Path) -> None:
    """Each schedule's learning rate per step under this launch (DDP or ZeRO-3 on several processes)."""
    from searchrl.engine.engine import Engine

    got = {}
    for name in SCHEDULES:
        eng = Engine(grad_accum=2, micro_batch_size=1, max_grad_norm=None)
        got[name] = learning_rates(name, eng)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"schedules-rank{eng.rank}.pkl", "wb") as f:
        pickle.dump(got, f)
    eng.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--case", action="append", default=[])
    a = p.parse_args()
    check_reduce(a.out)
    check_schedules(a.out)
    for case in a.case or list(CASES):
        run_case(a.world, a.model, a.out, case)


if __name__ == "__main__":
    main()
