"""`searchrl train EXP.yaml`: optional SFT warm start, the configured algorithm, evaluation, a curve and a table.

model (local build or model.path) --warm_start SFT on teacher trajectories--> <out>/sft/final
    --algorithm--> <out>/final --eval on eval.split--> results.md, learning_curve.png

SFT, DPO and the PRM read collected process data (``process_data.out``) when it is set; a PRM is
evaluated as best-of-N guidance of the policy it started from.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from searchrl.app.resources import Resources, local_model_dir
from searchrl.core.config import Experiment
from searchrl.core.errors import ConfigError
from searchrl.data.example import read_jsonl, write_jsonl


def teacher_sft_records(resources: Resources, passes: int) -> list[dict[str, Any]]:
    """Teacher trajectories for every train question, ``passes`` times with fresh noise and names; cached."""
    from searchrl.envs.synthetic.teacher import teacher_records

    if resources.world is None:
        raise ConfigError(
            "the SFT warm start uses the synthetic world's teacher; set data.source: synthetic",
            key="warm_start",
        )
    cache = resources.exp.out / "sft" / f"teacher-{passes}.jsonl"
    if cache.exists():
        return list(read_jsonl(cache))
    env, examples = resources.env(), resources.examples("train")
    records = []
    for p in range(passes):
        records += teacher_records(
            env,
            resources.world,
            examples,
            replace(resources.exp.teacher, seed=resources.exp.teacher.seed + p),
        )
    write_jsonl(cache, records)
    return records


def make_evaluator(resources: Resources, split: str, limit: int | None) -> Any:
    """Periodic evaluation inside a Trainer: greedy episodes of the live policy, each process on its shard
    of the questions. The policy is gathered once for the whole evaluation (under ZeRO-3 every gather is
    a collective, and shards take different numbers of turns)."""
    from searchrl.app.eval_episodes import episode_metrics, run_policy

    examples = resources.examples(split)[:limit]

    def evaluate(trainer: Any, step: int) -> dict[str, float]:
        eng = trainer.engine
        shard = examples[eng.rank :: eng.world_size]
        with eng.for_generation(trainer.policy) as model:
            states = run_policy(
                lambda: nullcontext(model),
                trainer.tokenizer,
                resources.env(),
                shard,
                resources.exp.rollout,
            )
        m = episode_metrics(eng.gather_objects(states))
        return {f"eval/{k}": float(v) for k, v in m.items() if isinstance(v, int | float)}

    return evaluate


def _shard(examples: list[Any], state: Any) -> list[Any]:
    return examples[state.process_index :: state.num_processes]


def _gathered(states: list[Any], state: Any) -> list[Any]:
    """Every process's episodes, on every process (one collective)."""
    if state.num_processes <= 1:
        return states
    from accelerate.utils import gather_object

    return list(gather_object(states))


def evaluate_final(resources: Resources, model_dir: Path, name: str, state: Any) -> dict[str, Any]:
    """A saved model on the evaluation split, each process on its shard of the questions; the main
    process writes the results."""
    from contextlib import nullcontext

    from searchrl.app.eval_episodes import add_judge_metrics, episode_metrics, run_policy, write_results
    from searchrl.models.load import load_model_and_tokenizer

    e = resources.exp
    model, tokenizer = load_model_and_tokenizer(model_dir, whole=True)
    shard = _shard(resources.examples(e.eval.split)[: e.eval.limit], state)
    states = run_policy(
        lambda: nullcontext(model),
        tokenizer,
        resources.env(),
        shard,
        e.rollout,
        e.eval.temperature,
    )
    everyone = _gathered(states, state)
    m = episode_metrics(everyone)
    m["predictions"] = f"eval/{name}.predictions.jsonl"  # per question, relative to the run directory
    if state.is_main_process:
        add_judge_metrics(m, everyone, e.eval.judge)  # one process asks the judge
        write_results(e.out / "eval", name, m, everyone)
    return m


def evaluate_best_of_n(
    resources: Resources, policy_dir: Path, prm_dir: Path, n: int, state: Any = None
) -> dict[str, Any]:
    """The policy guided by the PRM (RAG-Gym Algorithm 1) on the evaluation split (sharded over the
    processes of ``state``, when given)."""
    from searchrl.app.eval_episodes import add_judge_metrics, episode_metrics, run_best_of_n, write_results
    from searchrl.models.load import load_model_and_tokenizer
    from searchrl.rewards.prm_scorer import PRMScorer

    e = resources.exp
    policy, tok = load_model_and_tokenizer(policy_dir, whole=True)
    examples = resources.examples(e.eval.split)[: e.eval.limit]
    shard = _shard(examples, state) if state is not None else examples
    states = run_best_of_n(
        policy.eval(),
        tok,
        PRMScorer(prm_dir),
        resources.env(),
        shard,
        n,
        e.rollout,
        e.eval.best_of_temperature,
        e.rollout.batch_size,
    )
    everyone = _gathered(states, state) if state is not None else states
    m = episode_metrics(everyone)
    name = f"prm-best-of-{n}-{e.eval.split}"
    m["predictions"] = f"eval/{name}.predictions.jsonl"
    if state is None or state.is_main_process:
        add_judge_metrics(m, everyone, e.eval.judge)
        write_results(e.out / "eval", name, m, everyone)
    return m


def run_stage(
    resources: Resources,
    algorithm: str,
    config: Any,
    model: Path,
    trainer_cfg: Any,
    out: Path,
    records: list[dict[str, Any]] | None,
    resume: bool,
) -> Path:
    from searchrl.engine.checkpoint import has_weights
    from searchrl.engine.trainer import Trainer

    if has_weights(out / "final"):
        return out / "final"  # this stage finished in an earlier run (the export is atomic)
    if (out / "final").exists():  # an export interrupted by an older version: redo it from the checkpoints
        from accelerate import PartialState

        PartialState().print(
            f"{out / 'final'} has no weights (an interrupted export); it is redone"
            + (" from the last checkpoint" if resume else ": pass --resume to redo only the export")
        )
    trainer = Trainer(
        algorithm=algorithm,
        config=config,
        model_path=model.resolve(),
        cfg=trainer_cfg,
        out_dir=out,
        resources=resources,
        records=records,
        resume=resume,
        seed=resources.exp.seed,
    )
    evaluator = (
        make_evaluator(resources, trainer_cfg.eval_split, trainer_cfg.eval_limit)
        if trainer_cfg.eval_every
        else None
    )
    return trainer.run(evaluator)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def default_cuda_allocator(exp: Experiment, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set PyTorch's caching allocator to grow its segments (``expandable_segments:True``) for a training
    process, before CUDA starts, unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` (even to nothing) or vLLM's
    sleep mode runs in the process (its memory pool refuses expandable segments). The value set, or None.

    Why: with the fixed-size segments, the second training step's pass asked the driver for ~90 new blocks
    as activations of new shapes arrived; on an H200 that step took 5.9 s against 1.2-1.3 s for the later
    ones, and with expandable segments 1.9 s (benchmarks/results/gpu-h200-step_time-alloc-*.json,
    docs/benchmarks.md)."""
    import os

    env = os.environ if environ is None else environ
    sleep = exp.rollout.backend == "vllm" and bool(exp.rollout.backend_args.get("enable_sleep_mode"))
    if ALLOC_CONF in env or sleep:
        return None
    env[ALLOC_CONF] = "expandable_segments:True"
    return env[ALLOC_CONF]


def train(exp: Experiment, resume: bool = False, force: bool = False) -> dict[str, Any]:
    """Run `searchrl.app.plan.plan(exp)`: its stages, then its evaluations. ``force``: start over in a run
    directory trained with another config (its results are deleted). ``exp`` as
    `searchrl.app.experiment.check_arguments` returns it (resolved), or as loaded (resolved here)."""
    from searchrl.app.plan import BASE, plan
    from searchrl.app.rundir import check_run_dir, claim_run_dir
    from searchrl.engine.engine import distributed_state, wait_for_main

    default_cuda_allocator(exp)  # before anything starts CUDA in this process
    state = distributed_state(exp.distributed.timeout)
    p = plan(exp)
    resources = Resources(exp)
    out = exp.out
    records = None
    check_run_dir(exp, force, resume)  # every process reads it: they refuse together
    if resume and not (out / "checkpoints").is_dir() and not (out / "sft" / "checkpoints").is_dir():
        state.print(f"--resume: {out} has no checkpoints yet; training starts from step 0")
    if state.is_main_process:  # build the world, the local model and the teacher data once
        claim_run_dir(exp, force)
        local_model_dir(resources)
        if p.teacher_passes:
            records = teacher_sft_records(resources, p.teacher_passes)
    wait_for_main(state)
    if p.teacher_passes and records is None:  # the other processes read what the main one cached
        records = teacher_sft_records(resources, p.teacher_passes)
    models: dict[str, Path] = {BASE: local_model_dir(resources)}
    for stage in p.stages:
        data = records if stage.data == "teacher" else None
        if stage.data.startswith("process-") and p.process_data is not None:
            from searchrl.app.process_data import load_pairs, load_sft

            data = (load_pairs if stage.data == "process-pairs" else load_sft)(p.process_data)
        start = models.get(stage.start, Path(stage.start))
        models[stage.name] = run_stage(
            resources, stage.algorithm, stage.config, start, stage.trainer, stage.out, data, resume
        )
    results: dict[str, Any] = {}
    for ev in p.evaluations:  # every process evaluates its shard
        model = models.get(ev.model, Path(ev.model))
        if ev.guide is None:
            results[ev.name] = evaluate_final(resources, model, f"{ev.name}-{exp.eval.split}", state)
        else:
            results[ev.name] = evaluate_best_of_n(resources, model, models[ev.guide], ev.n, state)
    if state.is_main_process:
        from searchrl.app.eval_episodes import markdown_table

        table = markdown_table({f"{n} ({exp.eval.split})": m for n, m in results.items()})
        (out / "results.md").write_text(table + "\n")
        (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        from searchrl.app.plots import learning_curve

        learning_curve(out, out / "learning_curve.png")
        print("\n" + table)
        print(f"\nresults: {out / 'results.md'}  curve: {out / 'learning_curve.png'}")
    wait_for_main(state)
    return results
