"""The training loop every algorithm shares.

Per step: this process's share of the step's items -> ``algo.collect`` (rollouts + rewards, or dataset
records) -> masker -> no-grad passes for old and reference log-probs -> ``algo.prepare`` (advantages) ->
``epochs`` × ``mini_batches`` optimizer updates over micro-batches, with the loss aggregated over the
*global* batch -> metrics -> checkpoint. Data order depends only on (seed, step), and checkpoints hold the
RNG states, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from searchrl.algorithms import ALGORITHMS
from searchrl.algorithms.base import Algorithm, Context
from searchrl.algorithms.correction import RolloutCorrection
from searchrl.core.config import ConfigError, TrainerConfig
from searchrl.core.serving import failure_summary
from searchrl.engine.checkpoint import Checkpointer
from searchrl.engine.engine import Engine, NonFiniteError, distributed_state
from searchrl.engine.guards import Guards, Rollback, Trip
from searchrl.engine.metrics import MetricsSink
from searchrl.engine.precision import Float32Gradients, use_master_weights
from searchrl.engine.preemption import Preempted, Preemption
from searchrl.engine.rollouts import Rollouts
from searchrl.engine.samples import SampleRecorder
from searchrl.engine.schedule import Schedule, batch_shape, make_optimizer
from searchrl.engine.step import Optimized, StepShape, TrainingStep
from searchrl.models.load import unpartitioned
from searchrl.models.policy import Reference, load_policy
from searchrl.rollout.generator import GENERATORS, SamplingParams, generator_options

if TYPE_CHECKING:
    from searchrl.core.config import Experiment
    from searchrl.core.records import Doc, Example
    from searchrl.envs.search import SearchEnv


class Resources(Protocol):
    """What the trainer reads from the run's resources (`searchrl.app.resources.Resources`, a layer above)."""

    exp: Experiment

    @property
    def corpus(self) -> list[Doc]: ...

    def env(self) -> SearchEnv: ...

    def examples(self, split: str) -> list[Example]: ...

    def fresh(self) -> Resources: ...


class Trainer:
    """Built in the order the algorithm's `Requirements` dictate: batch shape, engine, policy (with a value
    head when asked), optimizer, what the algorithm is handed (`Context`), reference model, checkpoints; then
    the parts it is composed of: where the rows come from (`Rollouts`), the step (`TrainingStep`), the metrics
    (`MetricsSink`) and what a guard's trip does (`Rollback`). ``config`` is the algorithm's own typed config
    (`searchrl.algorithms.algorithm_config`), converted once when the experiment was planned."""

    def __init__(
        self,
        *,
        algorithm: str,
        config: Any,
        model_path: str | Path,
        cfg: TrainerConfig,
        out_dir: Path,
        resources: Resources,
        records: list[dict[str, Any]] | None = None,
        resume: bool = False,
        seed: int = 0,
    ) -> None:
        exp = resources.exp
        self.cfg, self.out, self.seed, self.resources, self.algorithm = (
            cfg,
            out_dir,
            seed,
            resources,
            algorithm,
        )
        self.model_path = model_path  # the rollout worker's copy is loaded from it under DeepSpeed
        algo_cls: Any = ALGORITHMS.get(algorithm)
        if not isinstance(config, algo_cls.Config):
            raise TypeError(
                f"Trainer(config=...) takes algorithm '{algorithm}''s {algo_cls.Config.__name__}, got "
                f"{type(config).__name__} (searchrl.algorithms.algorithm_config converts a dict)"
            )
        self.req = req = algo_cls.requires(config, exp.env)
        self._check_async(algo_cls, config)  # before anything is loaded
        rows, micro, accum = batch_shape(cfg, req, algorithm, distributed_state().num_processes)
        self.engine = eng = Engine(
            grad_accum=accum,
            micro_batch_size=micro,
            max_grad_norm=cfg.max_grad_norm,
            mixed_precision=cfg.mixed_precision,
            seed=seed,
        )
        policy, self.tokenizer = self._load_policy()
        groups = algo_cls.param_groups(config, policy, cfg.lr)
        master = use_master_weights(cfg.master_weights, groups, eng.is_deepspeed, eng.print)
        optimizer, scheduler = make_optimizer(cfg, groups, master_weights=master)
        self.policy, self.optimizer, self.scheduler = eng.prepare(policy, optimizer, scheduler)
        # with master weights, gradients are summed across micro-batches in float32 too
        grads32 = Float32Gradients.of(groups, eng.world_size > 1) if master and accum > 1 else None
        self.ctx = self._context(records)
        self.algo: Algorithm = algo_cls(config, self.ctx)
        if self.algo.softmax_negatives and not cfg.lean_logprobs:
            raise ConfigError(
                "a sampled softmax (sampled_softmax) needs the lean log-prob path",
                key="trainer.lean_logprobs",
                value=False,
                choices=["true"],
            )
        self.reference = (
            Reference(self.policy, eng, str(model_path), exp.model.dtype) if req.reference else None
        )
        # sampler-trainer correction of the online algorithms (None: the algorithm has no sampled log-probs)
        corr = getattr(config, "rollout_correction", None)
        correction: RolloutCorrection | None = corr if req.online and req.old_logprobs else None
        self.schedule = Schedule(self.algo.num_items(), cfg.batch_size, seed)
        self.ckpt = Checkpointer(eng, out_dir, self.policy, self.tokenizer, keep=cfg.keep_checkpoints)
        self.start_step = self._resume() if resume else 0
        temperature = exp.rollout.temperature if req.online else 1.0
        old_pass = _old_pass(req, cfg, correction)
        self._compose(
            StepShape(algorithm, rows, micro, seed, temperature, old_pass), grads32, correction, resume
        )

    def _compose(
        self,
        shape: StepShape,
        grads32: Float32Gradients | None,
        correction: RolloutCorrection | None,
        resume: bool,
    ) -> None:
        """The parts the trainer is made of, each handed what it uses: the sample recorder, the metrics sink,
        where the rows come from (`Rollouts`), the step (`TrainingStep`) and what a trip does (`Rollback`)."""
        cfg, eng, exp, out_dir = self.cfg, self.engine, self.resources.exp, self.out
        self.samples = SampleRecorder(
            out_dir, cfg.samples.groups, cfg.samples.every, self.tokenizer, enabled=eng.is_main
        )
        self.sink = MetricsSink(
            out_dir,
            cfg.steps,
            self.start_step,
            enabled=eng.is_main,
            tensorboard=cfg.tensorboard,
            wandb_project=cfg.wandb_project,
            desc=self.algorithm,
        )
        self.rollouts = Rollouts(
            engine=eng,
            algo=self.algo,
            ctx=self.ctx,
            policy=self.policy,
            tokenizer=self.tokenizer,
            schedule=self.schedule,
            cfg=cfg,
            rollout=exp.rollout,
            req=self.req,
            model_path=self.model_path,
            seed=self.seed,
            load_whole=self._whole_policy,
            worker_spec=lambda: {
                "resources": self.resources.fresh(),  # built again in the worker: nothing of this process's travels
                "exp": exp,
                "dtype": exp.model.dtype,
                "lora": exp.model.lora,
            },
        )
        self.training_step = TrainingStep(
            engine=eng,
            algo=self.algo,
            cfg=cfg,
            req=self.req,
            ctx=self.ctx,
            model=Optimized(
                self.policy, self.optimizer, self.scheduler, self.tokenizer, self.reference, grads32
            ),
            rollouts=self.rollouts,
            schedule=self.schedule,
            samples=self.samples,
            correction=correction,
            shape=shape,
        )
        # collapse-guard trips of this run (kept over resumes in guards.json)
        self.rollback = Rollback(
            cfg.guards, eng, self.ckpt, self.algo, self.optimizer, self.scheduler, self.sink, out_dir, resume
        )

    def step(self, step: int) -> dict[str, float]:
        """One training step (`TrainingStep`); its metrics, reduced over the processes."""
        return self.training_step(step)

    def _load_policy(self, training: bool = True) -> tuple[Any, Any]:
        """The policy as configured (LoRA, value head) and its tokenizer; activation checkpointing only for
        training (the rollout worker's copy never runs a backward pass)."""
        exp, req = self.resources.exp, self.req
        return load_policy(
            str(self.model_path),
            exp.model.dtype,
            exp.model.lora,
            req.value_head,
            req.detach_value_trunk,
            training and exp.model.gradient_checkpointing,
        )

    def _context(self, records: list[dict[str, Any]] | None) -> Context:
        """The environment, and for online algorithms a generator on the policy and the reward pipeline."""
        exp, resources, eng, online = self.resources.exp, self.resources, self.engine, self.req.online
        env = resources.env()
        generator = None
        rewards = None
        if online:
            from searchrl.rewards.pipeline import RewardPipeline

            generator = GENERATORS.get(exp.rollout.backend)(
                self.policy,
                self.tokenizer,
                env.stop_strings,
                batch_size=exp.rollout.batch_size,
                model_context=lambda: eng.for_generation(self.policy),
                continuous=exp.rollout.loop == "episode",
                **generator_options(exp.rollout),
            )
            if hasattr(generator, "start") and not self._worker_process():
                generator.start()  # an engine's memory is taken now; a worker process has its own engine
            rewards = RewardPipeline(
                exp.rewards,
                {"docs": lambda: {d.id: d for d in resources.corpus}, "retriever": lambda: env.retriever},
            )
            from searchrl.rollout.loop import check_prompt_room

            check_prompt_room(env, self.tokenizer, resources.examples("train"), exp.rollout.max_total_tokens)
        return Context(
            env=env,
            generator=generator,
            tokenizer=self.tokenizer,
            rewards=rewards,
            sampling=SamplingParams(exp.rollout.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens),
            max_total_tokens=exp.rollout.max_total_tokens,
            train_examples=resources.examples("train") if online else [],
            records=records,
            sum_all=eng.sum,
        )

    def _worker_process(self) -> bool:
        """Whether the rollouts run in a worker process (asynchronous, ``trainer.async_rollout.worker: process``)."""
        a = self.cfg.async_rollout
        return a.max_staleness > 0 and a.worker == "process"

    def _check_async(self, algo_cls: Any, algo_cfg: Any) -> None:
        """Refuse ``trainer.async_rollout`` where this version cannot run it, with the reason."""
        if self.cfg.async_rollout.max_staleness == 0:
            return
        from searchrl.rollout.async_rollout import refusal

        exp = self.resources.exp
        resamples = getattr(getattr(algo_cfg, "dynamic_sampling", None), "enabled", False)
        why = refusal(
            self.algorithm,
            self.req.online,
            not algo_cls.episodic,
            exp.rollout.loop,
            resamples,
            exp.env.retriever.name,
        )
        if why is not None:
            raise ConfigError(
                why,
                key="trainer.async_rollout.max_staleness",
                value=self.cfg.async_rollout.max_staleness,
                choices=["0"],
            )

    def _whole_policy(self) -> Any:
        """The policy's architecture loaded whole in this process, DeepSpeed hidden (the worker's copy)."""
        with unpartitioned():
            return self._load_policy(training=False)[0]

    def _resume(self) -> int:
        """The step of the latest checkpoint, restored (0 when there is none)."""
        latest = self.ckpt.latest()
        if latest is None:
            return 0
        state = self.ckpt.load(latest)
        self.algo.load_state_dict(state.get("algorithm", {}))
        self.engine.print(f"resumed from {latest} at step {int(state['step'])}")
        return int(state["step"])

    def run(self, evaluate: Any = None) -> Path:
        """Train to ``cfg.steps``; ``evaluate(model_dir_or_policy, step) -> metrics`` is called every
        ``eval_every`` steps. The collapse guards (``trainer.guards``) are checked on every step's metrics;
        a trip stops the run or rolls it back (`Rollback`). Returns the exported final model directory."""
        cfg, eng = self.cfg, self.engine
        guards = Guards(cfg.guards.monitors)
        step = self.start_step
        preemption = Preemption(cfg.preempt_grace_s)
        preemption.watch()
        self._check_services()
        if cfg.guards.on_trip == "rollback" and guards.monitors and step == 0 and self.ckpt.latest() is None:
            # the starting point, so that a trip within the first save_every steps has somewhere to roll back to
            with eng.phase("checkpoint", step):
                self.ckpt.save(0, {"metrics": {}, "algorithm": self.algo.state_dict()})
        try:
            while step < cfg.steps:
                done = step + 1
                curriculum = self._curriculum(step)
                try:
                    metrics = self.step(step)
                except NonFiniteError as exc:
                    # window 0: the step failed mid-update; the checkpoint before it is good
                    step = self.rollback(Trip(done, "non-finite", str(exc), math.nan, "finite", 0), guards)
                    self.rollouts.restart()
                    continue
                finally:
                    self._curriculum(None)
                metrics.update(curriculum)
                # every eval_every steps and at the last, so that the held-out curve ends at the final policy
                if (
                    evaluate is not None
                    and cfg.eval_every
                    and (done % cfg.eval_every == 0 or done == cfg.steps)
                ):
                    with eng.phase("evaluation", step):
                        metrics.update(evaluate(self, done))
                trip = guards.check(done, metrics)
                if guards.monitors or self.rollback.trips:
                    metrics["guard/trips"] = float(len(self.rollback.trips) + (trip is not None))
                self.sink.log(done, metrics)
                if trip is not None:
                    step = self.rollback(trip, guards)
                    self.rollouts.restart()
                    continue
                saved = done % cfg.save_every == 0 or done == cfg.steps
                if saved:
                    self._save(done, metrics)
                step = done
                if done < cfg.steps and preemption.agreed(eng):
                    self._preempted(done, metrics, preemption, saved)
        finally:
            preemption.unwatch()
            self.rollouts.close()
            self.sink.close()
            for line in failure_summary():
                eng.print(line)
            if self.rollback.trips:
                eng.print(
                    f"collapse guards: {len(self.rollback.trips)} trip(s), see {self.out / 'guards.json'}"
                )
        with eng.phase("final export"):
            return self.ckpt.export_final(self.out / "final")

    def _check_services(self) -> None:
        """The services the run depends on answer before its first step (a retrieval server a job starts
        beside training, a wrong URL): a retriever with a ``check`` (the HTTP one) is asked once."""
        retriever: Any = getattr(self.ctx.env, "retriever", None)
        retriever = getattr(retriever, "inner", retriever)  # behind the query cache
        if callable(getattr(retriever, "check", None)):
            retriever.check()

    def _curriculum(self, step: int | None) -> dict[str, float]:
        """A retriever with a schedule over training (the simulated search engine's noise) learns the step
        (None: the step is over; evaluation sees no schedule); its value is logged (``search/noise_p``)."""
        retriever: Any = getattr(self.ctx.env, "retriever", None)
        if not hasattr(retriever, "set_progress"):
            return {}
        retriever.set_progress(step, self.cfg.steps)
        return {"search/noise_p": float(retriever.noise)} if step is not None else {}

    def _save(self, done: int, metrics: dict[str, Any]) -> None:
        """A checkpoint after step ``done``; its duration is kept to judge whether one fits a grace period."""
        t0 = time.perf_counter()
        with self.engine.phase("checkpoint", done - 1):
            self.ckpt.save(done, {"metrics": metrics, "algorithm": self.algo.state_dict()})
        self._save_s = time.perf_counter() - t0

    def _preempted(self, done: int, metrics: dict[str, Any], preemption: Preemption, saved: bool) -> None:
        """A preemption signal reached some process: every process saves step ``done`` (unless it was just
        saved, or the save would not fit in the grace period) and the run stops with `Preempted`."""
        eng, last, estimate = self.engine, self.ckpt.latest(), getattr(self, "_save_s", 0.0)
        if not saved and preemption.save_fits(eng, estimate):
            self._save(done, metrics)
            saved, last = True, self.ckpt.latest()
        if saved:
            what = f"checkpoint {last} written"
        else:
            what = (
                f"no checkpoint written: a save takes about {estimate:.0f} s and {preemption.left_s():.0f} s "
                f"of trainer.preempt_grace_s were left; the last good one is {last}"
            )
        preemption.stopping = True
        raise Preempted(
            f"preempted by {preemption.name()} after step {done}: {what}", done if saved else None
        )


def _old_pass(req: Any, cfg: TrainerConfig, correction: RolloutCorrection | None) -> bool:
    """π_old from a no-grad pass before the updates, or, when each rollout batch gets one optimizer update
    and nothing reads π_old before it, from that update's own forward (the same weights), detached.
    ``rejected: drop`` needs every rejection before the update's first micro-batch normalises."""
    drops = correction is not None and correction.drops
    return bool(req.old_logprobs) and (
        req.old_in_prepare or req.value_head or cfg.epochs * cfg.mini_batches > 1 or drops
    )
