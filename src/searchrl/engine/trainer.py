"""The training loop every algorithm shares.

Per step: this process's share of the step's items -> ``algo.collect`` (rollouts + rewards, or dataset
records) -> masker -> no-grad passes for old and reference log-probs -> ``algo.prepare`` (advantages) ->
``epochs`` × ``mini_batches`` optimizer updates over micro-batches, with the loss aggregated over the
*global* batch -> metrics -> checkpoint. Data order depends only on (seed, step), and checkpoints hold the
RNG states, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from searchrl.aggregate import Max, Mean, Sum
from searchrl.algorithms import ALGORITHMS
from searchrl.algorithms.base import Algorithm, Context, Requirements
from searchrl.algorithms.correction import RolloutCorrection, correction_weights
from searchrl.config import ConfigError, TrainerConfig, from_dict
from searchrl.engine.checkpoint import Checkpointer
from searchrl.engine.engine import Engine, NonFiniteError, distributed_state
from searchrl.engine.guards import Guards, GuardTrip, Trip
from searchrl.engine.metrics import MetricsSink
from searchrl.engine.samples import SampleRecorder
from searchrl.functional import token_entropy, token_logprobs, token_weights
from searchrl.masking import build_batch
from searchrl.models.packing import pack
from searchrl.models.policy import Reference, forward, forward_lean, load_policy
from searchrl.rollout.generator import GENERATORS, SamplingParams
from searchrl.serving import check_failure_rates, failure_summary, service_metrics
from searchrl.types import RolloutBatch, Segment, Trajectory

if TYPE_CHECKING:
    from searchrl.config import Experiment
    from searchrl.data.corpus import Doc
    from searchrl.data.example import Example
    from searchrl.envs.search import SearchEnv


class Resources(Protocol):
    """What the trainer reads from the run's resources (`searchrl.runtime.Runtime`, a layer above)."""

    exp: Experiment

    @property
    def corpus(self) -> list[Doc]: ...

    def env(self) -> SearchEnv: ...

    def examples(self, split: str) -> list[Example]: ...


class Schedule:
    """Which training items a step uses: epoch-wise permutations seeded by (seed, epoch)."""

    def __init__(self, n_items: int, batch_size: int, seed: int) -> None:
        if n_items == 0:
            raise ValueError("no training items")
        self.n, self.batch, self.seed = n_items, batch_size, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            p = list(range(self.n))
            random.Random(self.seed * 100_003 + epoch).shuffle(p)
            self._perms[epoch] = p
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch, (step + 1) * self.batch):
            epoch, k = divmod(pos, self.n)
            out.append(self._perm(epoch)[k])
        return out


class Trainer:
    """Built in the order the algorithm's `Requirements` dictate: batch shape, engine, policy (with a value
    head when asked), optimizer, what the algorithm is handed (`Context`), reference model, checkpoints."""

    def __init__(
        self,
        *,
        algorithm: str,
        algorithm_args: dict[str, Any],
        model_path: str | Path,
        cfg: TrainerConfig,
        out_dir: Path,
        runtime: Resources,
        records: list[dict[str, Any]] | None = None,
        resume: bool = False,
        seed: int = 0,
    ) -> None:
        exp = runtime.exp
        self.cfg, self.out, self.seed, self.rt, self.algorithm = cfg, out_dir, seed, runtime, algorithm
        algo_cls: Any = ALGORITHMS.get(algorithm)
        algo_cfg = from_dict(algo_cls.Config, algorithm_args, source="experiment", key="algorithm")
        self.req = req = algo_cls.requires(algo_cfg, exp.env)
        self._check_async(algo_cls, algo_cfg)  # before anything is loaded
        self.rows, self.micro, accum = batch_shape(cfg, req, algorithm, distributed_state().num_processes)
        self.engine = eng = Engine(
            grad_accum=accum,
            micro_batch_size=self.micro,
            max_grad_norm=cfg.max_grad_norm,
            mixed_precision=cfg.mixed_precision,
            seed=seed,
        )
        policy, self.tokenizer = load_policy(
            str(model_path), exp.model.dtype, exp.model.lora, req.value_head, req.detach_value_trunk
        )
        optimizer, scheduler = make_optimizer(cfg, algo_cls.param_groups(algo_cfg, policy, cfg.lr))
        self.policy, self.optimizer, self.scheduler = eng.prepare(policy, optimizer, scheduler)
        self.temperature = exp.rollout.temperature if req.online else 1.0
        self.ctx = self._context(records)
        self.algo: Algorithm = algo_cls(algo_cfg, self.ctx)
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
        # π_old from a no-grad pass before the updates, or, when each rollout batch gets one optimizer update
        # and nothing reads π_old before it, from that update's own forward (the same weights), detached
        self.old_pass = req.old_logprobs and (
            req.old_in_prepare or req.value_head or cfg.epochs * cfg.mini_batches > 1
        )
        # sampler-trainer correction of the online algorithms (None: the algorithm has no sampled log-probs)
        corr = getattr(algo_cfg, "rollout_correction", None)
        self.correction: RolloutCorrection | None = corr if req.online and req.old_logprobs else None
        self.schedule = Schedule(self.algo.num_items(), cfg.batch_size, seed)
        self.pipeline: Any = None  # the asynchronous rollout worker (`rollout.async_rollout`), started by run
        self.ckpt = Checkpointer(eng, out_dir, self.policy, self.tokenizer, keep=cfg.keep_checkpoints)
        self.start_step = self._resume() if resume else 0
        self._service_totals: dict[str, float] = {}
        # collapse-guard trips of this run (kept over resumes in guards.json)
        log = out_dir / "guards.json"
        self._trip_log: list[dict[str, Any]] = (
            json.loads(log.read_text())["trips"] if resume and log.exists() else []
        )
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
            desc=algorithm,
        )

    def _context(self, records: list[dict[str, Any]] | None) -> Context:
        """The environment, and for online algorithms a generator on the policy and the reward pipeline."""
        exp, rt, eng, online = self.rt.exp, self.rt, self.engine, self.req.online
        env = rt.env()
        generator = None
        rewards = None
        if online:
            from searchrl.rewards.pipeline import RewardPipeline

            generator = GENERATORS.get(exp.rollout.backend)(
                self.policy,
                self.tokenizer,
                env.tags.stop_strings,
                batch_size=exp.rollout.batch_size,
                model_context=lambda: eng.for_generation(self.policy),
                continuous=exp.rollout.loop == "episode",
                **exp.rollout.backend_args,
            )
            rewards = RewardPipeline(exp.rewards, {"docs": lambda: {d.id: d for d in rt.corpus}})
            from searchrl.rollout.loop import check_prompt_room

            check_prompt_room(env, self.tokenizer, rt.examples("train"), exp.rollout.max_total_tokens)
        return Context(
            env=env,
            generator=generator,
            tokenizer=self.tokenizer,
            rewards=rewards,
            sampling=SamplingParams(exp.rollout.temperature, exp.rollout.top_p, exp.rollout.max_new_tokens),
            max_total_tokens=exp.rollout.max_total_tokens,
            train_examples=rt.examples("train") if online else [],
            records=records,
            sum_all=eng.sum,
        )

    def _check_async(self, algo_cls: Any, algo_cfg: Any) -> None:
        """Refuse ``trainer.async_rollout`` where this version cannot run it, with the reason."""
        if self.cfg.async_rollout.max_staleness == 0:
            return
        from accelerate.utils import DistributedType

        from searchrl.rollout.async_rollout import refusal

        exp = self.rt.exp
        state = distributed_state()
        world = state.num_processes
        resamples = getattr(getattr(algo_cfg, "dynamic_sampling", None), "enabled", False)
        backend, loop = exp.rollout.backend, exp.rollout.loop
        sharded = state.distributed_type == DistributedType.DEEPSPEED
        why = refusal(
            self.algorithm, self.req.online, not algo_cls.episodic, backend, loop, world, resamples, sharded
        )
        if why is not None:
            raise ConfigError(
                why,
                key="trainer.async_rollout.max_staleness",
                value=self.cfg.async_rollout.max_staleness,
                choices=["0"],
            )

    def _start_pipeline(self, step: int) -> None:
        """The asynchronous rollout worker, on a copy of the policy, producing steps ``step`` … on."""
        from searchrl.rollout.async_rollout import AsyncRollout

        if self.pipeline is not None:
            self.pipeline.close()
        exp, ctx, eng = self.rt.exp, self.ctx, self.engine
        self.pipeline = AsyncRollout(
            eng.unwrap(self.policy),
            lambda model: GENERATORS.get("hf")(
                model,
                self.tokenizer,
                ctx.env.tags.stop_strings,
                batch_size=exp.rollout.batch_size,
                continuous=True,
                **exp.rollout.backend_args,
            ),
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
        )
        self.pipeline.start()

    def _collect(self, step: int, indices: list[int]) -> tuple[list[Trajectory], dict[str, float]]:
        """This step's training rows: from the asynchronous worker, scored here, or collected now."""
        if self.cfg.async_rollout.max_staleness:
            if self.pipeline is None:
                self._start_pipeline(step)
            trajs, metrics = self.pipeline.take(step)
            assert self.ctx.rewards is not None
            return trajs, {**metrics, **self.ctx.rewards(trajs)}
        with self._generation_session():
            return self.algo.collect(indices)

    def _resume(self) -> int:
        """The step of the latest checkpoint, restored (0 when there is none)."""
        latest = self.ckpt.latest()
        if latest is None:
            return 0
        state = self.ckpt.load(latest)
        self.algo.load_state_dict(state.get("algorithm", {}))
        self.engine.print(f"resumed from {latest} at step {int(state['step'])}")
        return int(state["step"])

    # --------------------------------------------------------------------------------------- passes
    def _logprobs(
        self, model: Any, batch: RolloutBatch, entropy: bool = False, values: bool = False, negatives: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (and entropy, values) of the batch's action tokens under ``model``; 0 elsewhere.
        ``trainer.lean_logprobs``: the output layer applied at the action tokens only, in tiles
        (`models.lean_head`); otherwise from the full logits. ``trainer.packing``: the micro-batch's rows
        run as one packed row (`models.packing`) and the results are scattered back."""
        ids, mask, pos = batch.input_ids, batch.loss_mask, None
        attn: torch.Tensor | None = batch.attention_mask
        packed = pack(ids, batch.attention_mask, mask) if self.cfg.packing else None
        if packed is not None:
            ids, attn, mask, pos = packed.input_ids, None, packed.loss_mask, packed.position_ids
        if self.cfg.lean_logprobs:
            logp, ent, v = forward_lean(
                model, ids, attn, mask, self.temperature, entropy, values, negatives, position_ids=pos
            )
        else:
            logits, v = forward(model, ids, attn, values=values, position_ids=pos)
            logp = token_logprobs(logits, ids, self.temperature, mask=mask)
            ent = None
            if entropy:
                with torch.no_grad():
                    ent = token_entropy(logits.detach() / self.temperature, mask)
        if packed is None:
            return logp, ent, v
        return tuple(None if x is None else packed.unpack(x) for x in (logp, ent, v))  # type: ignore[return-value]

    @torch.no_grad()
    def _no_grad_pass(
        self, model: Any, batch: RolloutBatch, values: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, T) of the action tokens, and values (B, T) when asked, in micro-batches."""
        model = self.engine.for_no_grad(model)
        order = batch.attention_mask.sum(-1).argsort(stable=True)
        out = torch.zeros_like(batch.loss_mask)
        vals = torch.zeros_like(batch.loss_mask) if values else None
        for i in range(0, len(batch), self.micro):
            idx = order[i : i + self.micro]
            mb = batch.select(idx.tolist())
            width = int(mb.attention_mask.sum(-1).max())  # drop all-padding columns
            lp, _, v = self._logprobs(model, mb.trim(width), values=values)
            out[idx, :width] = lp
            if vals is not None and v is not None:
                vals[idx, :width] = v
        return out * batch.loss_mask, None if vals is None else vals * batch.loss_mask

    def _mismatch(self, old_logp: torch.Tensor, batch: RolloutBatch) -> None:
        """The sampler's log-probs against the trainer's π_old over ``batch``'s action tokens: accumulates
        |difference| and the correction's diagnostics, and puts the correction weights (`algorithms.correction`,
        ``algorithm.rollout_correction``) in ``batch.extras["is_weight"]`` unless its mode is none."""
        diff = (old_logp - batch.sampled_logprobs).abs() * batch.loss_mask
        d = self._sampler_diff
        d[0] += float(diff.sum())
        d[1] += float(batch.loss_mask.sum())
        d[2] = max(d[2], float(diff.max())) if diff.numel() else d[2]
        corr = self.correction
        if corr is None:
            return
        w, stats = correction_weights(old_logp, batch.sampled_logprobs, batch.loss_mask, corr)
        if corr.mode != "none":
            batch.extras["is_weight"] = w
        acc = self._corr_sums
        for k in ("tokens", "k3_kl", "cut_tokens", "cut_seq", "w_sum", "w_sq_sum"):
            acc[k] += float(stats[k].sum())
        acc["sequences"] += float((stats["tokens"] > 0).sum())

    def _mismatch_metrics(self) -> dict[str, float]:
        """Per-step metrics of the sampler-trainer mismatch (globally combined; ``rollout_corr/ess`` is derived
        after the reduction)."""
        total, tokens, worst = self._sampler_diff
        out: dict[str, float] = {
            "rollout/logprob_abs_diff": Mean(total, tokens),
            "rollout/logprob_max_diff": Max(worst),
        }
        if self.correction is not None:
            a = self._corr_sums
            out.update(
                {
                    "rollout_corr/k3_kl": Mean(a["k3_kl"], a["tokens"]),  # KL(μ ‖ π_old) per token
                    "rollout_corr/cut_token_frac": Mean(a["cut_tokens"], a["tokens"]),  # truncated / rejected
                    "rollout_corr/cut_seq_frac": Mean(a["cut_seq"], a["sequences"]),
                    "rollout_corr/w_mean": Mean(a["w_sum"], a["tokens"]),
                    "rollout_corr/w_sq_mean": Mean(a["w_sq_sum"], a["tokens"]),
                }
            )
        return out

    def _length_order(self, batch: RolloutBatch) -> list[int]:
        """Rows by length (less padding per micro-batch); pairs stay adjacent, by their longer row."""
        lengths = batch.attention_mask.sum(-1)
        if self.req.rows != "pairs":
            return lengths.argsort(stable=True).tolist()
        pair_len = torch.maximum(lengths[0::2], lengths[1::2])
        return [r for p in pair_len.argsort(stable=True).tolist() for r in (2 * p, 2 * p + 1)]

    def _update(self, batch: RolloutBatch, sums: dict[str, float]) -> None:
        """One optimizer update over ``batch`` (this process's mini-batch), globally normalised."""
        eng, algo = self.engine, self.algo
        g_tokens = eng.sum(batch.loss_mask.sum())
        g_seqs = eng.sum(float((batch.loss_mask.sum(-1) > 0).sum()))
        norm_len = float(self.ctx.max_total_tokens)
        self.policy.train()
        # micro-batches of similar lengths waste less compute on padding; the global normalisation makes
        # the loss independent of how sequences are grouped
        batch = batch.select(self._length_order(batch))
        for i in range(0, len(batch), self.micro):
            mb = batch.select(slice(i, i + self.micro))
            mb = mb.trim(int(mb.attention_mask.sum(-1).max()))
            with eng.accumulate(self.policy):
                logp, ent, values = self._logprobs(
                    self.policy, mb, self.cfg.log_entropy, self.req.value_head, algo.softmax_negatives
                )
                if self.req.old_logprobs and not self.old_pass:  # one update per batch: π_old is π_θ now
                    mb.extras["old_logp"] = logp.detach()
                    self._mismatch(mb.extras["old_logp"], mb)
                loss_tok, metrics = algo.loss(logp, ent, mb, values)
                self.samples.record(mb, logp)
                w = token_weights(mb.loss_mask, algo.loss_agg, g_tokens, g_seqs, norm_len)
                loss = (loss_tok * w).sum()
                eng.backward(loss)
                if eng.sync_gradients:
                    # the norm is global: every process stops here together, never one alone
                    grad_norm = eng.clip_grad_norm(self.policy)
                    if not math.isfinite(grad_norm):
                        bad = eng.take_nonfinite_loss()
                        raise NonFiniteError(
                            f"loss is {bad}" if bad is not None else f"gradient norm is {grad_norm}"
                        )
                    self._grad_norms.append(grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
            # metrics: global token means; pair metrics (one value per row) are means over the pairs
            mean_w = w if self.req.rows == "pairs" else mb.loss_mask / max(g_tokens, 1.0)
            sums["train/loss"] += float(loss.detach()) / (self.cfg.epochs * self.cfg.mini_batches)
            for k, v in metrics.items():
                sums[f"train/{k}"] += float((v.detach() * mean_w).sum()) / (
                    self.cfg.epochs * self.cfg.mini_batches
                )

    # --------------------------------------------------------------------------------------- loop
    def step(self, step: int) -> dict[str, float]:
        """One training step. Every process issues the same collectives whatever its data: the policy is
        gathered once for the whole collection, every process trains on the same number of rows, and the
        metrics are reduced over a key set all processes agree on."""
        eng, algo, cfg = self.engine, self.algo, self.cfg
        t0 = time.perf_counter()
        indices = self.schedule.indices(step)[eng.rank :: eng.world_size]
        algo.step = step
        with eng.phase("collect", step):
            trajs, collect_metrics = self._collect(step, indices)
            _debug_stall(eng, step, "collect")
        trajs = self._pad(trajs)
        t_collect = time.perf_counter() - t0
        batch = build_batch(trajs, self.tokenizer.pad_token_id, self.ctx.max_total_tokens).to(eng.device)
        self.samples.start(step, trajs, batch)
        local: dict[str, float] = {**collect_metrics}
        self._sampler_diff = [0.0, 0.0, 0.0]  # |sampled − recomputed log-prob|: sum, tokens, max
        self._corr_sums: dict[str, float] = defaultdict(float)
        if self.old_pass:
            with eng.phase("old log-probs", step):
                batch.extras["old_logp"], old_values = self._no_grad_pass(
                    self.policy, batch, self.req.value_head
                )
            if old_values is not None:
                batch.extras["old_values"] = old_values
            self._mismatch(batch.extras["old_logp"], batch)
        if self.reference is not None:
            with eng.phase("reference log-probs", step), self.reference.model() as ref:
                batch.extras["ref_logp"] = self._no_grad_pass(ref, batch)[0]
        with eng.phase("advantages", step):
            local.update(algo.prepare(batch))
        sums: dict[str, float] = defaultdict(float)
        self._grad_norms: list[float] = []
        n = len(batch)
        gen = torch.Generator().manual_seed(self.seed * 7919 + step)
        with eng.phase("update", step):
            for _ in range(cfg.epochs):
                order = torch.randperm(n, generator=gen) if cfg.mini_batches > 1 else torch.arange(n)
                if self.req.rows == "pairs" and cfg.mini_batches > 1:  # shuffle pairs, not rows
                    pairs = torch.randperm(n // 2, generator=gen)
                    order = torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()
                for chunk in order.chunk(cfg.mini_batches):
                    self._update(batch.select(chunk.tolist()), sums)
        if self.req.old_logprobs:
            # the sampler's log-probs against the trainer's recompute: stale or mismatched weights show here
            local.update(self._mismatch_metrics())
        if self.ctx.generator is not None:
            self.ctx.generator.release()  # the weights changed (a vLLM engine re-syncs before its next rollout)
        if self.pipeline is not None:  # the worker samples with these weights from its next decode step
            self.pipeline.sync(eng.unwrap(self.policy), step + 1)
        trained = batch.loss_mask.sum(-1) > 0  # rows with loss tokens (padding rows have none)
        local.update({k: Sum(v) for k, v in sums.items()})  # shares of globally normalised means
        if self._grad_norms:  # global already: every process holds the same value
            local["train/grad_norm"] = sum(self._grad_norms) / len(self._grad_norms)
        if self.ctx.generator is not None:  # online: rewards of fresh episodes (offline rows carry labels)
            local["reward/mean"] = Mean(float(batch.rewards[trained].sum()), float(trained.sum()))
        episodes = [t for t in trajs if t.state is not None]
        if episodes:
            from searchrl.answers import exact_match

            em = sum(exact_match(t.answer or "", t.example.answers) for t in episodes)
            local["train/em"] = Mean(em, len(episodes))
        local.update(
            {
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/sequences": Sum(float(trained.sum())),
                "train/action_tokens": Sum(float(batch.loss_mask.sum())),
                "time/collect_s": Max(t_collect),
                "time/step_s": Max(time.perf_counter() - t0),
            }
        )
        local.update(service_metrics())  # judge / summarizer requests and failures since the last step
        with eng.phase("metrics", step):
            _debug_stall(eng, step, "metrics")
            out = eng.reduce_metrics(local)
        out["time/tokens_per_s"] = out["train/action_tokens"] / max(out["time/step_s"], 1e-9)
        if (
            "rollout_corr/w_sq_mean" in out
        ):  # normalised effective sample size of the weights, (Σw)² / (n Σw²)
            out["rollout_corr/ess"] = out["rollout_corr/w_mean"] ** 2 / max(
                out["rollout_corr/w_sq_mean"], 1e-30
            )
        for k, v in out.items():  # totals over the run, equal on every process: all stop together
            if k.startswith("service/"):
                self._service_totals[k] = self._service_totals.get(k, 0.0) + v
        check_failure_rates(self._service_totals)
        self.samples.finish(out)
        return out

    def _generation_session(self) -> Any:
        """The policy gathered once for a whole collection (a ZeRO-3 collective), reused by every
        generation call inside; nothing for offline algorithms."""
        return self.engine.for_generation(self.policy) if self.ctx.generator is not None else nullcontext()

    def _pad(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Exactly ``self.rows`` rows on every process: the same micro-batches, so the same collectives.
        Missing rows are empty (no loss tokens, no reward, a group of their own)."""
        if len(trajs) > self.rows:
            raise RuntimeError(
                f"algorithm '{self.algorithm}' returned {len(trajs)} training rows for a step, more "
                f"than the {self.rows} it declared (requirements.samples_per_item x items per process)"
            )
        pad = self.tokenizer.pad_token_id
        base = -1 - self.engine.rank * self.rows
        return trajs + [
            Trajectory(
                trajs[0].example if trajs else None,  # type: ignore[arg-type]
                [Segment("prompt", [pad, pad])],
                group_id=base - j,
            )
            for j in range(self.rows - len(trajs))
        ]

    def run(self, evaluate: Any = None) -> Path:
        """Train to ``cfg.steps``; ``evaluate(model_dir_or_policy, step) -> metrics`` is called every
        ``eval_every`` steps. The collapse guards (``trainer.guards``) are checked on every step's metrics;
        a trip stops the run or rolls it back (`_on_trip`). Returns the exported final model directory."""
        cfg, eng = self.cfg, self.engine
        guards = Guards(cfg.guards.monitors)
        step = self.start_step
        try:
            while step < cfg.steps:
                done = step + 1
                try:
                    metrics = self.step(step)
                except NonFiniteError as exc:
                    # window 0: the step failed mid-update; the checkpoint before it is good
                    step = self._on_trip(Trip(done, "non-finite", str(exc), math.nan, "finite", 0), guards)
                    self._restart_pipeline()
                    continue
                # every eval_every steps and at the last, so that the held-out curve ends at the final policy
                if (
                    evaluate is not None
                    and cfg.eval_every
                    and (done % cfg.eval_every == 0 or done == cfg.steps)
                ):
                    with eng.phase("evaluation", step):
                        metrics.update(evaluate(self, done))
                trip = guards.check(done, metrics)
                if guards.monitors or self._trip_log:
                    metrics["guard/trips"] = float(len(self._trip_log) + (trip is not None))
                self.sink.log(done, metrics)
                if trip is not None:
                    step = self._on_trip(trip, guards)
                    self._restart_pipeline()
                    continue
                if done % cfg.save_every == 0 or done == cfg.steps:
                    with eng.phase("checkpoint", step):
                        self.ckpt.save(done, {"metrics": metrics, "algorithm": self.algo.state_dict()})
                step = done
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
                self.pipeline = None
            self.sink.close()
            for line in failure_summary():
                eng.print(line)
            if self._trip_log:
                eng.print(f"collapse guards: {len(self._trip_log)} trip(s), see {self.out / 'guards.json'}")
        with eng.phase("final export"):
            return self.ckpt.export_final(self.out / "final")

    def _restart_pipeline(self) -> None:
        """After a rollback the episodes sampled ahead came from the discarded weights: the worker restarts
        (lazily, at the step the run continues from, on the restored weights)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    def _on_trip(self, trip: Trip, guards: Guards) -> int:
        """A guard tripped (or a value went non-finite) at ``trip.step``: record it, then stop with a message
        naming the monitor and the last good checkpoint, or (``on_trip: rollback``) restore that checkpoint,
        scale the learning rate by ``lr_scale`` and return the step to continue from. The last good
        checkpoint is the newest one saved before the window of bad values began: step t's metrics come
        from the policy of checkpoint t − 1, so a window over steps T−W+1…T condemns checkpoints T−W on."""
        g, eng = self.cfg.guards, self.engine
        good = self.ckpt.latest_before(trip.step - trip.window - 1)
        rollbacks = sum(t.get("action") == "rollback" for t in self._trip_log)
        rollback = g.on_trip == "rollback" and good is not None and rollbacks < g.max_rollbacks
        entry = {**trip.record(), "action": "rollback" if rollback else "stop", "checkpoint": str(good)}
        if rollback:
            assert good is not None
            state = self.ckpt.load(good)
            self.algo.load_state_dict(state.get("algorithm", {}))
            eng.scale_lr(self.optimizer, self.scheduler, g.lr_scale)
            self.ckpt.discard_after(good)
            entry["discarded_metrics"] = self.sink.rewind(int(state["step"]))
            entry["lr_scale"] = g.lr_scale ** (rollbacks + 1)
        self._trip_log.append(entry)
        if eng.is_main:
            (self.out / "guards.json").write_text(json.dumps({"trips": self._trip_log}, indent=1) + "\n")
        if rollback:
            guards.reset()
            eng.print(
                f"{trip.describe()}; rolled back to {good} (step {state['step']}), learning rate x{entry['lr_scale']:g}"
            )
            return int(state["step"])
        why = (
            ""
            if g.on_trip == "stop"
            else f" (no checkpoint before step {trip.step - trip.window} to roll back to)"
            if good is None
            else f" (trainer.guards.max_rollbacks = {g.max_rollbacks} reached)"
        )
        where = f"the last good checkpoint is {good or '(none yet)'}"
        if trip.bound == "finite":
            raise NonFiniteError(
                f"training stopped at step {trip.step}: {trip.metric}{why}. Nothing was saved for this step; "
                f"{where}. Lower trainer.lr or check the rewards."
            ) from None
        raise GuardTrip(f"training stopped by a collapse guard at {trip.describe()}{why}; {where}.")


def _debug_stall(eng: Engine, step: int, phase: str) -> None:
    """Test hook for the collective timeout. ``SEARCHRL_DEBUG_DESYNC="RANK:STEP:PHASE:ACTION"`` makes that
    process, at that step (counted from 1) and phase, either issue one collective the others do not
    (ACTION ``extra``: the processes are out of step) or stall for a number of seconds (ACTION a number:
    a stuck process). Either way the others must fail within the timeout, never hang."""
    spec = os.environ.get("SEARCHRL_DEBUG_DESYNC")
    if not spec:
        return
    rank, at, where, action = spec.split(":")
    if int(rank) != eng.rank or int(at) != step + 1 or where != phase:
        return
    if action == "extra":
        eng.sum(1.0)
    else:
        time.sleep(float(action))


def batch_shape(cfg: TrainerConfig, req: Requirements, algorithm: str, world: int) -> tuple[int, int, int]:
    """(rows, micro-batch size, gradient-accumulation steps) of one process: ``trainer.batch_size`` items
    shared over ``world`` processes, ``req.samples_per_item`` rows each, in ``trainer.mini_batches``."""
    per_proc = _divide(cfg.batch_size, world, "trainer.batch_size", "the number of processes")
    rows = per_proc * req.samples_per_item  # rows every process trains on per step (padded)
    mini = _divide(rows, cfg.mini_batches, "sequences per process", "trainer.mini_batches")
    micro = min(cfg.micro_batch_size, mini)
    if req.rows == "pairs" and (micro % 2 or mini % 2):
        raise ConfigError(
            f"{algorithm} trains on (chosen, rejected) pairs: the micro-batch size ({micro}) "
            "and sequences per mini-batch must be even",
            key="trainer.micro_batch_size",
        )
    return rows, micro, _divide(mini, micro, "sequences per mini-batch", "trainer.micro_batch_size")


def make_optimizer(cfg: TrainerConfig, groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over ``groups`` and its learning-rate schedule (per update: steps × epochs × mini-batches)."""
    from transformers import get_scheduler

    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.SGD
    optimizer = opt_cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_step = cfg.epochs * cfg.mini_batches
    # "constant" with warm-up steps means a linear warm-up, then constant
    name: str = "constant_with_warmup" if cfg.schedule == "constant" and cfg.warmup_steps else cfg.schedule
    extra, warmup = None, cfg.warmup_steps
    if cfg.schedule == "wsd":  # the decay takes its share of the steps; warm-up gets at most the rest
        decay = max(1, round(cfg.steps * cfg.decay_fraction))
        name, extra, warmup = (
            "warmup_stable_decay",
            {"num_decay_steps": decay * per_step},
            min(warmup, cfg.steps - decay),
        )
    scheduler = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup * per_step,
        num_training_steps=cfg.steps * per_step,
        scheduler_specific_kwargs=extra,
    )
    return optimizer, scheduler


def _divide(a: int, b: int, what_a: str, what_b: str) -> int:
    if b <= 0 or a % b:
        raise ConfigError(f"{what_a} ({a}) must be a positive multiple of {what_b} ({b})", key="trainer")
    return a // b
