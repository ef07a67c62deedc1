"""What `searchrl train` will do, as data: `plan(experiment)` returns the training stages (each with its
algorithm, data source and starting model) and the evaluations, without loading anything.

    warm start (SFT on the teacher, or a given checkpoint) -> the algorithm -> evaluations

- SFT itself on the teacher needs no warm start; SFT, DPO and the PRM read collected process data
  (``process_data.out``) when it is set (DPO and the PRM always need it).
- Every policy is evaluated on ``eval.split``: the untrained model, the warm start, the trained one. A
  PRM is a scorer, not a policy: it is evaluated guiding the start policy, best-of-N for each N in
  ``eval.best_of`` (RAG-Gym Algorithm 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from searchrl.core.config import AlgorithmSettings, Experiment, TrainerConfig
from searchrl.core.errors import ConfigError

BASE, WARM = "base", "sft"  # the names of the start models a stage or an evaluation may refer to


@dataclass(frozen=True)
class Stage:
    name: str  # the stage's own name, the key its trained model is known by
    algorithm: str
    config: AlgorithmSettings  # the algorithm's typed ``Config``, converted once (`searchrl.app.experiment.resolve`)
    trainer: TrainerConfig
    out: Path  # the stage's directory (checkpoints/, final/, metrics.jsonl)
    start: str  # BASE, WARM, or a model directory
    data: Literal["online", "teacher", "process-trajectories", "process-pairs"]


@dataclass(frozen=True)
class Evaluation:
    name: str  # the row of the results table
    model: str  # BASE, WARM, a stage's name, or a model directory
    guide: str | None = None  # a scorer stage's name: best-of-N of ``model`` guided by it
    n: int = 1


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    evaluations: tuple[Evaluation, ...]
    teacher_passes: int  # teacher data to build first (0: none)
    process_data: str | None  # collected process data the main stage reads


def plan(exp: Experiment) -> Plan:
    """The stages and evaluations of ``exp`` (its algorithm sections converted here unless
    `searchrl.app.experiment.check_arguments` already did: `resolve`)."""
    from searchrl.algorithms import requirements
    from searchrl.app.experiment import resolve

    if exp.algorithm is None:
        raise ConfigError(
            "`searchrl train` needs an algorithm section, e.g. algorithm: {name: grpo}", key="algorithm"
        )
    exp = resolve(exp)
    assert exp.algorithm is not None and exp.algorithm.settings is not None
    algo, settings = exp.algorithm.name, exp.algorithm.settings
    req = requirements(algo, settings, exp.env)
    kind = req.data  # None (online), "trajectories" or "pairs"
    process = exp.process_data.out if kind else None
    if kind == "pairs" and process is None:
        raise ConfigError(
            f"algorithm '{algo}' trains on step-level preference pairs: set process_data.out to data "
            "from `searchrl collect-process-data`",
            key="process_data.out",
        )
    ws = exp.warm_start
    teacher_main = kind == "trajectories" and process is None
    warm = ws is not None and not teacher_main  # the teacher warm start precedes all but teacher SFT itself
    stages: list[Stage] = []
    evaluations = [Evaluation("untrained", BASE)]
    start = BASE
    teacher_passes = ws.teacher_passes if (teacher_main and ws) else (1 if teacher_main else 0)
    if warm and ws is not None:
        if ws.checkpoint is not None:
            start = str(ws.checkpoint)
        else:
            assert ws.settings is not None  # `resolve` typed it
            stages.append(Stage(WARM, "sft", ws.settings, ws.trainer, exp.out / "sft", BASE, "teacher"))
            start = WARM
            teacher_passes = ws.teacher_passes
        evaluations.append(Evaluation(WARM, start))
    data = "online" if kind is None else "teacher" if teacher_main else f"process-{kind}"
    name = algo if algo != WARM or not warm else f"{algo} (process data)"
    stages.append(Stage(name, algo, settings, exp.trainer, exp.out, start, data))  # type: ignore[arg-type]
    if req.acts:
        evaluations.append(Evaluation(name, name))
    else:
        evaluations += [Evaluation(f"{algo} best-of-{n}", start, guide=name, n=n) for n in exp.eval.best_of]
    return Plan(tuple(stages), tuple(evaluations), teacher_passes, str(process) if process else None)


def check_stages(exp: Experiment, source: str = "<config>", world: int | None = None) -> None:
    """What each training stage refuses when it starts, checked at load by the same functions the stage runs
    (so `validate` and `train` cannot drift): the plan itself (`searchrl.app.plan.plan`), teacher data only
    on the synthetic world, each stage's batch shape (`searchrl.engine.schedule.batch_shape`) on ``world``
    processes (default: ``WORLD_SIZE``, as `accelerate launch` sets it, else 1), and a sampled softmax only
    on the lean log-prob path."""
    from searchrl.algorithms import requirements
    from searchrl.engine.schedule import batch_shape

    try:
        p = plan(exp)
    except ConfigError as exc:
        raise exc.at(source) from None
    if p.teacher_passes and exp.data.source != "synthetic":
        raise ConfigError(
            f"the SFT warm start trains on the synthetic world's scripted teacher, and data.source is "
            f"{exp.data.source!r}",
            file=source,
            key="warm_start",
            hint="warm_start: null (start from model.path), or warm_start: {checkpoint: DIR} (a model you "
            "fine-tuned), or process data (process_data.out) for an SFT stage",
        )
    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    for stage in p.stages:
        section = "warm_start.trainer" if stage.name == WARM else "trainer"
        req = requirements(stage.algorithm, stage.config, exp.env, source)
        try:
            batch_shape(stage.trainer, req, stage.algorithm, world)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc.problem} in the {stage.name} stage" + (f" on {world} processes" if world > 1 else ""),
                file=source,
                key=section if exc.key == "trainer" else (exc.key or section).replace("trainer", section, 1),
                hint=f"{section}.batch_size is split over the processes, then times the rows each item "
                f"gives ({req.samples_per_item} here), into {section}.mini_batches of "
                f"{section}.micro_batch_size",
            ) from None
        if getattr(stage.config, "sampled_softmax", 0) and not stage.trainer.lean_logprobs:
            raise ConfigError(
                "a sampled softmax (sampled_softmax) needs the lean log-prob path",
                file=source,
                key=f"{section}.lean_logprobs",
                value=False,
                choices=["true"],
            )
