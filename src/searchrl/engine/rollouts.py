"""Where a training step's rows come from: collected now by the algorithm (the policy gathered once for the
whole collection), or taken from the asynchronous rollout worker (`searchrl.rollout.async_rollout`, or its
process form `searchrl.rollout.worker_process`), which this object starts at the step a run begins or resumes
from, restarts after a rollback, and ships each optimizer step's weights to.

It sits in the engine rather than beside the worker in `rollout/` because starting and feeding the worker
gathers the policy's partitioned parameters (ZeRO-3, `engine.worker_weights`), an engine concern.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from searchrl.core.types import Trajectory
from searchrl.engine.worker_weights import gathered, whole_copy
from searchrl.models.weights import trainable_names
from searchrl.rollout.generator import GENERATORS, generator_options

if TYPE_CHECKING:
    from searchrl.algorithms.base import Algorithm, Context, Requirements
    from searchrl.core.config import RolloutConfig, TrainerConfig
    from searchrl.engine.engine import Engine
    from searchrl.engine.schedule import Schedule


class Rollouts:
    """This process's training rows of a step (`collect`), and the asynchronous worker's lifecycle
    (`start`, `restart`, `ship`, `close`) when ``trainer.async_rollout.max_staleness`` > 0."""

    def __init__(
        self,
        *,
        engine: Engine,
        algo: Algorithm,
        ctx: Context,
        policy: Any,
        tokenizer: Any,
        schedule: Schedule,
        cfg: TrainerConfig,
        rollout: RolloutConfig,
        req: Requirements,
        model_path: str | Path,
        seed: int,
        load_whole: Callable[[], Any],
        worker_spec: Callable[[], dict[str, Any]],
    ) -> None:
        """``load_whole``: the policy's architecture loaded whole in this process (the thread worker's copy);
        ``worker_spec``: what a worker process rebuilds its run from (the run's resources and experiment)."""
        self.engine, self.algo, self.ctx, self.policy, self.tokenizer = engine, algo, ctx, policy, tokenizer
        self.schedule, self.cfg, self.rollout, self.req = schedule, cfg, rollout, req
        self.model_path, self.seed = model_path, seed
        self._load_whole, self._worker_spec = load_whole, worker_spec
        self.worker: Any = None  # the asynchronous rollout worker, started lazily by `collect`
        self._ship: Callable[[int], None] = lambda version: None

    @property
    def asynchronous(self) -> bool:
        return bool(self.cfg.async_rollout.max_staleness)

    def collect(self, step: int, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """This step's training rows and their metrics: the asynchronous worker's episodes through the algorithm's
        own post-processing (`Algorithm.accept`: scored, then finished, as it treats what it collects), or
        collected now by the algorithm."""
        if self.asynchronous:
            if self.worker is None:
                self.start(step)
            return self.algo.accept(*self.worker.take(step))
        with self.generation_session():
            return self.algo.collect(indices)

    def generation_session(self) -> Any:
        """The policy gathered once for a whole collection (a ZeRO-3 collective), reused by every
        generation call inside; nothing for offline algorithms."""
        return self.engine.for_generation(self.policy) if self.ctx.generator is not None else nullcontext()

    def ship(self, version: int) -> None:
        """The weights of optimizer step ``version`` into the worker's sampler (nothing without a worker)."""
        if self.worker is not None:
            self._ship(version)

    def restart(self) -> None:
        """After a rollback the episodes sampled ahead came from the discarded weights: the worker restarts
        (lazily, at the step the run continues from, on the restored weights)."""
        self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def start(self, step: int) -> None:
        """The asynchronous rollout worker producing steps ``step`` … on, and how the weights of each optimizer
        step reach its sampler: with the HF backend a whole copy of the policy, filled from the trainable
        parameters (gathered under ZeRO-3, the adapter only with LoRA); with vLLM the process's engine, loaded
        by its own sync (gathered, LoRA merged, the prefixes of requests in flight kept)."""
        from searchrl.rollout.async_rollout import AsyncRollout

        self.close()
        ctx, eng = self.ctx, self.engine
        gen: Any = ctx.generator
        copy, shipped = None, []
        if self.cfg.async_rollout.worker == "process":
            self._start_process(step)
            return
        with eng.phase("rollout worker copy", step):
            if self.rollout.backend == "vllm":
                gen.sync(reset_prefix_cache=False)
            else:
                copy = whole_copy(eng, self.policy, self._load_whole)
                shipped = trainable_names(eng.unwrap(self.policy))
                gen = GENERATORS.get("hf")(
                    copy,
                    self.tokenizer,
                    ctx.env.stop_strings,
                    batch_size=self.rollout.batch_size,
                    continuous=True,
                    **generator_options(self.rollout),
                )
        self.worker = worker = AsyncRollout(
            copy,
            gen,
            ctx.env,
            self.tokenizer,
            ctx.sampling,
            ctx.train_examples,
            lambda step: self.schedule.indices(step)[eng.rank :: eng.world_size],  # this process's share
            self.algo.cfg.group_size,
            ctx.max_total_tokens,
            self.cfg.async_rollout.max_staleness,
            start_step=step,
            end_step=self.cfg.steps,
            shipped=shipped,
        )

        def ship(version: int) -> None:
            if copy is None:
                worker.sync_with(lambda: gen.sync(reset_prefix_cache=False), version)
            else:
                with gathered(eng, self.policy, shipped) as w:
                    worker.sync(w, version)

        self._ship = ship
        worker.start()

    def _start_process(self, step: int) -> None:
        """The rollout worker in a process of its own (`rollout.worker_process`): it loads the policy as this
        process does, gets every parameter once (gathered under ZeRO-3) and the trainable ones after each
        optimizer step, through shared memory."""
        from searchrl.rollout.worker_process import ProcessRollout, WorkerSpec

        ctx, eng, cfg = self.ctx, self.engine, self.cfg
        shipped = trainable_names(eng.unwrap(self.policy))
        mine = [self.schedule.indices(s)[eng.rank :: eng.world_size] for s in range(step, cfg.steps)]
        spec = WorkerSpec(
            **self._worker_spec(),  # the run's resources and experiment, built again in the worker
            model_path=str(self.model_path),
            value_head=self.req.value_head,
            detach_trunk=self.req.detach_value_trunk,
            device=str(eng.device),
            examples={i: ctx.train_examples[i] for idx in mine for i in idx},
            indices=tuple(tuple(idx) for idx in mine),
            params=ctx.sampling,
            group_size=self.algo.cfg.group_size,
            max_total_tokens=ctx.max_total_tokens,
            max_staleness=cfg.async_rollout.max_staleness,
            start_step=step,
            end_step=cfg.steps,
            shipped=tuple(shipped),
            threads=cfg.async_rollout.worker_threads,
            cpus=tuple(cfg.async_rollout.worker_cpus),
            seed=self.seed * 1009 + eng.rank * 101 + step,
        )
        with eng.phase("rollout worker process", step), gathered(eng, self.policy) as weights:
            self.worker = worker = ProcessRollout(spec, weights, cfg.async_rollout.max_restarts)

        def ship(version: int) -> None:
            with gathered(eng, self.policy, shipped) as w:
                worker.sync(w, version)

        self._ship = ship
        worker.start()
