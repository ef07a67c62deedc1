"""One training step of the shared loop (the `Trainer`'s step, phase by phase): collect and mask this
process's rows, the no-grad log-prob passes (π_old, reference) and the sampler-trainer mismatch, the
algorithm's advantages, the optimizer updates over globally normalised micro-batches, and the step's metrics."""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from searchrl.algorithms.base import PROBE_KEY, Algorithm, Context, Requirements
from searchrl.algorithms.correction import RolloutCorrection, correction_weights
from searchrl.core.aggregate import Max, Mean, Sum
from searchrl.core.config import TrainerConfig
from searchrl.core.functional import token_entropy, token_logprobs, token_weights
from searchrl.core.masking import build_batch
from searchrl.core.serving import check_failure_rates, service_metrics
from searchrl.core.types import RolloutBatch, Segment, Trajectory
from searchrl.engine.balance import balance
from searchrl.engine.engine import Engine, NonFiniteError
from searchrl.engine.precision import Float32Gradients
from searchrl.engine.rollouts import Rollouts
from searchrl.engine.samples import SampleRecorder
from searchrl.engine.schedule import Schedule
from searchrl.envs.context import last_rows
from searchrl.models.packing import Packed, pack
from searchrl.models.policy import Reference, forward, forward_lean
from searchrl.models.prefix import attention_for, pack_shared, prefix_mask_kind
from searchrl.models.prefix_cache import cached_cost, common_prefix
from searchrl.rewards.pipeline import episode_metrics


def peak_memory() -> dict[str, float]:
    """This process's peak memory so far, the largest over processes: resident memory (GB; ``ru_maxrss`` is
    in kB on Linux, bytes on macOS) and, on CUDA, the tensors' peak allocation on its device (GB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, float] = {"mem/peak_rss_gb": Max(rss / (1e9 if sys.platform == "darwin" else 1e6))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["mem/peak_gpu_gb"] = Max(torch.cuda.max_memory_allocated() / 1e9)
    return out


@dataclass
class Optimized:
    """The model a step trains and what updates it."""

    policy: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    reference: Reference | None = None  # the frozen reference model, where the algorithm reads its log-probs
    # float32 sums of the low-precision gradients across an update's micro-batches (with master weights)
    grads32: Float32Gradients | None = None


@dataclass
class StepShape:
    """How every step is laid out, decided once by the trainer."""

    algorithm: str  # the algorithm's registry name (for messages)
    rows: int  # training rows per process per step (the algorithm's declared count, padded to)
    micro: int  # rows per micro-batch
    seed: int
    temperature: float  # the sampling temperature the log-probs are computed at (1 offline)
    old_pass: bool  # π_old from a no-grad pass before the updates (else from the one update's own forward)


class TrainingStep:
    """One step of the shared loop, given everything it works on: the engine, the algorithm (and the `Context`
    it was built with), the model being trained, where the rows come from, the schedule of items, the recorder
    of samples and the sampler-trainer correction. `searchrl.engine.trainer.Trainer` builds it."""

    def __init__(
        self,
        *,
        engine: Engine,
        algo: Algorithm,
        cfg: TrainerConfig,
        req: Requirements,
        ctx: Context,
        model: Optimized,
        rollouts: Rollouts,
        schedule: Schedule,
        samples: SampleRecorder,
        correction: RolloutCorrection | None,
        shape: StepShape,
    ) -> None:
        self.engine, self.algo, self.cfg, self.req, self.ctx = engine, algo, cfg, req, ctx
        self.model, self.rollouts, self.schedule, self.samples = model, rollouts, schedule, samples
        self.correction, self.shape = correction, shape
        self.service_totals: dict[str, float] = {}  # judge / summarizer requests and failures over the run
        # this step's sampler-trainer accumulators and gradient norms (reset by `_collect_batch`, `_updates`)
        self._sampler_diff: list[float] = []
        self._version_diff: list[float] = []
        self._corr_sums: dict[str, float] = defaultdict(float)
        self._grad_norms: list[float] = []

    def __call__(self, step: int) -> dict[str, float]:
        return self.step(step)

    def _logprobs(
        self, model: Any, batch: RolloutBatch, entropy: bool = False, values: bool = False, negatives: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probs (and entropy, values) of the batch's action tokens under ``model``; 0 elsewhere.
        ``trainer.lean_logprobs``: the output layer applied at the action tokens only, in tiles
        (`models.lean_head`); otherwise from the full logits. ``trainer.packing``: the micro-batch's rows
        run as one packed row (`models.packing`) and the results are scattered back.
        ``trainer.prefix_cache_tokens``: a long prefix common to all rows runs once (`models.prefix_cache`)."""
        ids, mask, pos = batch.input_ids, batch.loss_mask, None
        attn: torch.Tensor | None = batch.attention_mask
        prefix = self._cached_prefix(model, batch)
        packed = self._pack(model, batch) if self.cfg.packing else None
        if packed is not None and prefix and packed.attention is not None:
            (R, C), (B, T) = packed.input_ids.shape, ids.shape
            if cached_cost(B, T, prefix) < cached_cost(R, C, prefix):
                packed = None  # after the cached prefix the rows are cheaper padded than as a tree
        if packed is not None:
            ids, mask, pos = packed.input_ids, packed.loss_mask, packed.position_ids
            attn = packed.attention
            prefix = prefix if attn is not None else 0  # position-id packing has no mask to extend
        if self.cfg.lean_logprobs:
            logp, ent, v = forward_lean(
                model,
                ids,
                attn,
                mask,
                self.shape.temperature,
                entropy,
                values,
                negatives,
                position_ids=pos,
                prefix=prefix,
            )
        else:
            logits, v = forward(model, ids, attn, values=values, position_ids=pos)
            logp = token_logprobs(logits, ids, self.shape.temperature, mask=mask)
            ent = None
            if entropy:
                with torch.no_grad():
                    ent = token_entropy(logits.detach() / self.shape.temperature, mask)
        if packed is None:
            return logp, ent, v
        return tuple(None if x is None else packed.unpack(x) for x in (logp, ent, v))  # type: ignore[return-value]

    def _cached_prefix(self, model: Any, batch: RolloutBatch) -> int:
        """The leading tokens all rows of the micro-batch share, if at least ``trainer.prefix_cache_tokens``:
        they run once through the KV cache (`models.prefix_cache`); else 0. With the SDPA or eager attention
        kernel (tested; flash-attention's variable-length path with a cache is not)."""
        least = self.cfg.prefix_cache_tokens
        if (
            not (self.cfg.share_prefix and self.cfg.lean_logprobs and least)
            or prefix_mask_kind(model) is None
        ):
            return 0
        n = common_prefix(batch.input_ids, batch.attention_mask)
        return n if n >= least else 0

    def _pack(self, model: Any, batch: RolloutBatch) -> Packed:
        """The micro-batch packed (`models.packing`), rows with the same context sharing it where the model's
        attention kernel takes a custom mask (``trainer.share_prefix``, `models.prefix`)."""
        ids, attn, mask = batch.input_ids, batch.attention_mask, batch.loss_mask
        kind = prefix_mask_kind(model) if self.cfg.share_prefix else None
        shared = pack_shared(ids, attn, mask) if kind is not None else None
        if kind is None or shared is None or shared.attention is None:  # no kernel for the mask, or no gain
            return pack(ids, attn, mask)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        shared.attention = attention_for(shared.attention, kind, dtype)
        return shared

    @torch.no_grad()
    def _no_grad_pass(
        self, model: Any, batch: RolloutBatch, values: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, T) of the action tokens, and values (B, T) when asked, in micro-batches."""
        model = self.engine.for_no_grad(model)
        order = torch.tensor(self._length_order(batch), dtype=torch.long)
        out = torch.zeros_like(batch.loss_mask)
        vals = torch.zeros_like(batch.loss_mask) if values else None
        for i in range(0, len(batch), self.shape.micro):
            idx = order[i : i + self.shape.micro]
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
        ``algorithm.rollout_correction``) in ``batch.extras.is_weight`` unless its mode is none."""
        diff = (old_logp - batch.sampled_logprobs).abs() * batch.loss_mask
        d = self._sampler_diff
        d[0] += float(diff.sum())
        d[1] += float(batch.loss_mask.sum())
        d[2] = max(d[2], float(diff.max())) if diff.numel() else d[2]
        versions = batch.extras.versions
        if versions is not None:  # asynchronous rollouts: tokens the trainer's own weights sampled, and older
            fresh = batch.loss_mask * (versions == self.algo.step)
            stale = batch.loss_mask * ((versions >= 0) & (versions != self.algo.step))
            v = self._version_diff
            v[0] += float((diff * fresh).sum())
            v[1] += float(fresh.sum())
            v[2] = max(v[2], float((diff * fresh).max())) if diff.numel() else v[2]
            v[3] += float((diff * stale).sum())
            v[4] += float(stale.sum())
        corr = self.correction
        if corr is None:
            return
        w, stats = correction_weights(old_logp, batch.sampled_logprobs, batch.loss_mask, corr)
        if corr.mode != "none":
            batch.extras.is_weight = w
        if corr.drops:  # verl's: rejected tokens leave the loss normaliser (`algorithms.correction`)
            batch.extras.norm_mask = batch.loss_mask * (w > 0)
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
        if self.rollouts.worker is not None:
            # split by the version that sampled: the trainer's current weights (the kernels' mismatch, and in a
            # partial rollout the keys and values older versions cached) and older versions (staleness)
            f_sum, f_n, f_max, s_sum, s_n = self._version_diff
            out["async/logprob_abs_diff_fresh"] = Mean(f_sum, f_n)
            if f_n:  # a maximum over no tokens would read as a perfect match
                out["async/logprob_max_diff_fresh"] = Max(f_max)
            out["async/logprob_abs_diff_stale"] = Mean(s_sum, s_n)
            out["async/fresh_token_frac"] = Mean(f_n, f_n + s_n)
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
        """The order rows are cut into micro-batches. With shared prefixes (``trainer.packing`` and
        ``trainer.share_prefix``): by their tokens, so that rows sharing a prefix (a group's prompt, a system
        prompt, branches of one episode) meet in one micro-batch, where `models.prefix` runs it once (packing
        removes the padding a mixed-length micro-batch would carry). Otherwise by length (less padding per
        micro-batch). Pairs stay adjacent, by their first row's tokens or their longer row."""
        if self.cfg.packing and self.cfg.share_prefix:
            ids, real = batch.input_ids.tolist(), batch.attention_mask.sum(-1).tolist()
            key = lambda r: ids[r][: int(real[r])]  # noqa: E731
            if self.req.rows != "pairs":
                return sorted(range(len(batch)), key=key)
            return [r for p in sorted(range(0, len(batch), 2), key=key) for r in (p, p + 1)]
        lengths = batch.attention_mask.sum(-1)
        if self.req.rows != "pairs":
            return lengths.argsort(stable=True).tolist()
        pair_len = torch.maximum(lengths[0::2], lengths[1::2])
        return [r for p in pair_len.argsort(stable=True).tolist() for r in (2 * p, 2 * p + 1)]

    def _update(self, batch: RolloutBatch, sums: dict[str, float]) -> None:
        """One optimizer update over ``batch`` (this process's mini-batch), globally normalised."""
        eng, algo = self.engine, self.algo
        norm = batch.norm_mask  # the loss normaliser's tokens
        g_tokens = eng.sum(norm.sum())
        g_seqs = eng.sum(float((norm.sum(-1) > 0).sum()))
        norm_len = float(self.ctx.max_total_tokens)
        self.model.policy.train()
        # micro-batches of similar lengths waste less compute on padding; the global normalisation makes
        # the loss independent of how sequences are grouped
        batch = batch.select(self._length_order(batch))
        if self.model.grads32 is not None:
            self.model.grads32.clear()
        for i in range(0, len(batch), self.shape.micro):
            mb = batch.select(slice(i, i + self.shape.micro))
            mb = mb.trim(int(mb.attention_mask.sum(-1).max()))
            with eng.accumulate(self.model.policy):
                logp, ent, values = self._logprobs(
                    self.model.policy,
                    mb,
                    self.cfg.log_entropy or self.req.entropy,
                    self.req.value_head,
                    algo.softmax_negatives,
                )
                if (
                    self.req.old_logprobs and not self.shape.old_pass
                ):  # one update per batch: π_old is π_θ now
                    mb.extras.old_logp = logp.detach()
                    self._mismatch(mb.extras.old_logp, mb)
                loss_tok, metrics = algo.loss(logp, ent, mb, values)
                self.samples.record(mb, logp)
                w = token_weights(mb.norm_mask, algo.loss_agg, g_tokens, g_seqs, norm_len)
                loss = (loss_tok * w).sum()
                if self.model.grads32 is not None:
                    self.model.grads32.before_backward(last=eng.sync_gradients)
                eng.backward(loss)
                if self.model.grads32 is not None:
                    self.model.grads32.after_backward(last=eng.sync_gradients)
                if eng.sync_gradients:
                    # the norm is global: every process stops here together, never one alone
                    grad_norm = eng.clip_grad_norm(self.model.policy)
                    if not math.isfinite(grad_norm):
                        bad = eng.take_nonfinite_loss()
                        raise NonFiniteError(
                            f"loss is {bad}" if bad is not None else f"gradient norm is {grad_norm}"
                        )
                    self._grad_norms.append(grad_norm)
                self.model.optimizer.step()
                self.model.scheduler.step()
                self.model.optimizer.zero_grad()
            # metrics: global token means; pair metrics (one value per row) are means over the pairs
            mean_w = w if self.req.rows == "pairs" else mb.norm_mask / max(g_tokens, 1.0)
            sums["train/loss"] += float(loss.detach()) / (self.cfg.epochs * self.cfg.mini_batches)
            for k, v in metrics.items():
                sums[f"train/{k}"] += float((v.detach() * mean_w).sum()) / (
                    self.cfg.epochs * self.cfg.mini_batches
                )

    def step(self, step: int) -> dict[str, float]:
        """One training step, phase by phase: collect and mask, the no-grad passes (π_old, reference),
        advantages, the optimizer updates, then the metrics. Every process issues the same collectives whatever
        its data: the policy is gathered once for the whole collection, every process trains on the same
        number of rows, and the metrics are reduced over a key set all processes agree on."""
        t0 = time.perf_counter()
        self.algo.step = step
        trajs, batch, local = self._collect_batch(step)
        t_collect = time.perf_counter() - t0
        self._old_and_reference(batch, step)
        if self.req.probes:
            t_probe = time.perf_counter()
            self._probe_pass(trajs, batch, step)
            local["time/probe_s"] = Max(time.perf_counter() - t_probe)
        with self.engine.phase("advantages", step):
            local.update(self.algo.prepare(batch))
        sums = self._updates(batch, step)
        if self.req.old_logprobs:
            # the sampler's log-probs against the trainer's recompute: stale or mismatched weights show here
            local.update(self._mismatch_metrics())
        if self.ctx.generator is not None:
            self.ctx.generator.release()  # the weights changed (a vLLM engine re-syncs before its next rollout)
        if (
            self.rollouts.worker is not None
        ):  # the worker samples with these weights from its next decode step
            with self.engine.phase("weight sync", step):
                self.rollouts.ship(step + 1)
        local.update(self._step_metrics(trajs, batch, sums, t_collect, t0))
        out = self._reduce(local, step)
        self.samples.finish(out)
        return out

    def _collect_batch(self, step: int) -> tuple[list[Trajectory], RolloutBatch, dict[str, float]]:
        """This process's rows of step ``step`` (padded to the same count on every process), masked."""
        eng = self.engine
        indices = self.schedule.indices(step)[eng.rank :: eng.world_size]
        with eng.phase("collect", step):
            trajs, collect_metrics = self.rollouts.collect(step, indices)
            _debug_stall(eng, step, "collect")
        if self.cfg.balance_ranks:  # whole groups moved to even out the processes' tokens (`engine.balance`)
            trajs, moved = balance(trajs, eng, self.shape.rows)
            collect_metrics = {**collect_metrics, **moved}
        trajs = self._pad(trajs)
        batch = build_batch(trajs, self.model.tokenizer.pad_token_id, self.ctx.max_total_tokens).to(
            eng.device
        )
        self.samples.start(step, trajs, batch)
        self._sampler_diff = [0.0, 0.0, 0.0]  # |sampled − recomputed log-prob|: sum, tokens, max
        self._version_diff = [0.0] * 5  # the same over tokens of the current version (sum, n, max) and older
        self._corr_sums = defaultdict(float)
        return trajs, batch, {**collect_metrics}

    def _old_and_reference(self, batch: RolloutBatch, step: int) -> None:
        """π_old's log-probs (and values) and the reference's, where the algorithm reads them, into extras."""
        eng = self.engine
        if self.shape.old_pass:
            with eng.phase("old log-probs", step):
                batch.extras.old_logp, old_values = self._no_grad_pass(
                    self.model.policy, batch, self.req.value_head
                )
            if old_values is not None:
                batch.extras.old_values = old_values
            self._mismatch(batch.extras.old_logp, batch)
        if self.model.reference is not None:
            with eng.phase("reference log-probs", step), self.model.reference.model() as ref:
                batch.extras.ref_logp = self._no_grad_pass(ref, batch)[0]

    def _probe_pass(self, trajs: list[Trajectory], batch: RolloutBatch, step: int) -> None:
        """The algorithm's probes (`Algorithm.probes`, IGPO's answer probes) scored by the policy before the
        update in the no-grad pass: each probe's mean log-prob of its scored span into
        ``batch.extras.more[PROBE_KEY]`` (B, S) at its row and step slot, NaN where none. Every process
        runs as many probe rows (the largest count, padded) so a sharded model's gathers line up."""
        probes = self.algo.probes(trajs, batch)
        pad = self.model.tokenizer.pad_token_id
        most = max(self.engine.gather_objects([len(probes)]))
        out = torch.full(batch.step_mask.shape, float("nan"), device=batch.loss_mask.device)
        if most:
            rows = [
                Trajectory(
                    trajs[0].example,
                    [Segment("prompt", p.ids[: p.start]), Segment("action", p.ids[p.start : p.end])],
                )
                for p in probes
            ]
            rows += [
                Trajectory(trajs[0].example, [Segment("prompt", [pad]), Segment("action", [pad])])
                for _ in range(most - len(probes))
            ]
            with self.engine.phase("probe log-probs", step):
                pb = build_batch(rows, pad).to(self.engine.device)
                logp = self._no_grad_pass(self.model.policy, pb)[0]
            mean = logp.sum(-1) / pb.loss_mask.sum(-1).clamp(min=1)
            for i, p in enumerate(probes):
                out[p.row, p.slot] = mean[i]
        batch.extras.more[PROBE_KEY] = out

    def _updates(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``epochs`` passes over the batch in ``mini_batches`` optimizer updates; the summed loss metrics."""
        cfg = self.cfg
        sums: dict[str, float] = defaultdict(float)
        self._grad_norms = []
        n = len(batch)
        gen = torch.Generator().manual_seed(self.shape.seed * 7919 + step)
        with self.engine.phase("update", step):
            for _ in range(cfg.epochs):
                order = torch.randperm(n, generator=gen) if cfg.mini_batches > 1 else torch.arange(n)
                if self.req.rows == "pairs" and cfg.mini_batches > 1:  # shuffle pairs, not rows
                    pairs = torch.randperm(n // 2, generator=gen)
                    order = torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()
                for chunk in order.chunk(cfg.mini_batches):
                    self._update(batch.select(chunk.tolist()), sums)
        return sums

    def _step_metrics(
        self,
        trajs: list[Trajectory],
        batch: RolloutBatch,
        sums: dict[str, float],
        t_collect: float,
        t0: float,
    ) -> dict[str, float]:
        """This process's share of the step's metrics (`searchrl.core.aggregate` values, reduced later)."""
        local: dict[str, float] = {}
        trained = batch.loss_mask.sum(-1) > 0  # rows with loss tokens (padding rows have none)
        last = last_rows(trajs)  # a folded episode's rows (`envs.context`): its outcome counted once
        ends = torch.tensor(last, device=trained.device) & trained
        local.update({k: Sum(v) for k, v in sums.items()})  # shares of globally normalised means
        if self._grad_norms:  # global already: every process holds the same value
            local["train/grad_norm"] = sum(self._grad_norms) / len(self._grad_norms)
        if self.ctx.generator is not None:  # online: rewards of fresh episodes (offline rows carry labels)
            local["reward/mean"] = Mean(float(batch.rewards[ends].sum()), float(ends.sum()))
        local.update(episode_metrics(trajs))  # the reward layer's per-episode measures
        local.update(
            {
                "train/lr": self.model.scheduler.get_last_lr()[0],
                "train/sequences": Sum(float(trained.sum())),
                "train/action_tokens": Sum(float(batch.loss_mask.sum())),
                "time/collect_s": Max(t_collect),
                "time/step_s": Max(time.perf_counter() - t0),
            }
        )
        local.update(service_metrics())  # judge / summarizer requests and failures since the last step
        local.update(peak_memory())
        return local

    def _reduce(self, local: dict[str, float], step: int) -> dict[str, float]:
        """The step's metrics over every process, with the ones derived from the reduced values."""
        with self.engine.phase("metrics", step):
            _debug_stall(self.engine, step, "metrics")
            out = self.engine.reduce_metrics(local)
        out["time/tokens_per_s"] = out["train/action_tokens"] / max(out["time/step_s"], 1e-9)
        if (
            "rollout_corr/w_sq_mean" in out
        ):  # normalised effective sample size of the weights, (Σw)² / (n Σw²)
            out["rollout_corr/ess"] = out["rollout_corr/w_mean"] ** 2 / max(
                out["rollout_corr/w_sq_mean"], 1e-30
            )
        for k, v in out.items():  # totals over the run, equal on every process: all stop together
            if k.startswith("service/"):
                self.service_totals[k] = self.service_totals.get(k, 0.0) + v
        check_failure_rates(self.service_totals)
        return out

    def _pad(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Exactly ``self.shape.rows`` rows on every process: the same micro-batches, so the same collectives.
        Missing rows are empty (no loss tokens, no reward, a group of their own)."""
        if len(trajs) > self.shape.rows:
            raise RuntimeError(
                f"algorithm '{self.shape.algorithm}' returned {len(trajs)} training rows for a step, more "
                f"than the {self.shape.rows} it declared (requirements.samples_per_item x items per process)"
            )
        pad = self.model.tokenizer.pad_token_id
        base = -1 - self.engine.rank * self.shape.rows
        return trajs + [
            Trajectory(
                trajs[0].example if trajs else None,  # type: ignore[arg-type]
                [Segment("prompt", [pad, pad])],
                group_id=base - j,
            )
            for j in range(self.shape.rows - len(trajs))
        ]


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
