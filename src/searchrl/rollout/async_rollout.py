"""Asynchronous rollouts under a staleness cap, with partial rollouts.

A worker thread keeps a continuous batch of episodes decoding (the per-episode agent loop of
`searchrl.rollout.agent_loop`, on the generator's ``stream``) on its own copy of the policy (HF backend) or
on the process's vLLM engine (vLLM backend), while the trainer trains on earlier episodes. After each
optimizer step the trainer ships the weights (`sync`, `sync_with`): the worker loads them between two decode
steps, so episodes in flight go on with the new weights (partial rollouts: nothing is dropped) and every
token records the policy version whose forward sampled it. The keys and values
already cached for a running episode are kept, as in vLLM-based partial rollouts; the recorded log-probs
are those of the computation that sampled, so the sampler-trainer correction (`algorithms.correction`)
weighs exactly what happened.

**The staleness cap.** Training step i consumes the episodes of step i's questions (the trainer's schedule),
in order, whatever their length. The worker starts step j's episodes only once the policy has version
≥ j − ``max_staleness`` (AReaL's admission rule, Fu et al. 2025 §5.1, with versions counted in optimizer steps).
A token of step i's batch was therefore sampled by a version ≥ i − max_staleness when step i trains on it:
the cap holds by construction, and a long episode is never dropped or overtaken by later questions (the
starvation that consuming whatever finishes first causes: tinker-cookbook #822, verl #6780). While step i
waits for its longest episode, the worker decodes steps i+1 … i+max_staleness, so the continuous batch
stays full. ``max_staleness: 0`` is the synchronous trainer (it does not use this module).

The worker is a thread of the training process (PyTorch releases the GIL inside its kernels, so decoding
and training overlap on separate cores), or runs in a process of its own that drives this same class
(`searchrl.rollout.worker_process`, ``trainer.async_rollout.worker: process``; with vLLM its engine then
starts in that process). Under DDP or DeepSpeed (ZeRO-3 included) each process runs its own
worker on its share of every step's questions, with a whole copy of the policy that the trainer fills after
each optimizer step (`searchrl.engine.worker_weights`: under ZeRO-3 one gather of the trainable parameters, the
adapter only with LoRA), or with its vLLM engine. A run is not bit-reproducible (which version samples a
token depends on timing); a resumed run restarts the worker at its checkpoint's step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from searchrl.core.aggregate import Max, Mean, Sum
from searchrl.core.records import Example
from searchrl.core.types import Trajectory
from searchrl.envs.search import SearchEnv
from searchrl.models.weights import load_into
from searchrl.rollout.agent_loop import WINDOW
from searchrl.rollout.generator import Generation, SamplingParams
from searchrl.rollout.loop import RolloutStats, finish, ready, start_trajectories, step_env


def refusal(
    algorithm: str,
    online: bool,
    own_collect: bool,
    loop: str,
    resamples: bool = False,
    retriever: str = "bm25",
) -> str | None:
    """Why this version cannot run ``algorithm`` with asynchronous rollouts (None: it can). ``own_collect``:
    the algorithm replaces the episode collection (SLATE's step-level search); ``resamples``: it draws more
    questions within a step (DAPO's dynamic sampling); ``retriever``: ``env.retriever.name``. The one place this is
    decided: `searchrl validate` and `train` ask it before any stage runs, the trainer again when built. Under DDP or DeepSpeed (ZeRO-3 included) each process
    runs its own worker on its own share of each step's questions, on a whole copy of the policy (HF backend)
    or on its vLLM engine, either of which gets the trainer's weights after every update."""
    if not online:
        return f"'{algorithm}' trains on given records; asynchronous rollouts are for online algorithms"
    if own_collect:
        return (
            f"'{algorithm}' collects step by step: it builds its rows from the policy's samples within the step "
            "(SLATE's candidates of each step, Tree-GRPO's and ARPO's branches from earlier steps), so they cannot run "
            "ahead of the trainer; use grpo, ppo or steppo"
        )
    if resamples:
        return (
            "dynamic sampling draws more questions until a step's groups are informative, so a step's "
            "episodes are not known ahead of the trainer; set algorithm.dynamic_sampling.enabled: false"
        )
    if loop != "episode":
        return (
            "the rollout worker runs the per-episode loop (rollout.loop: episode; episodes join and leave "
            f"the running batch one by one), not loop '{loop}'"
        )
    if retriever == "simulated":
        return (
            "the simulated retriever's noise curriculum follows the trainer's step, which the asynchronous "
            "worker's copy of the retriever does not see: train it synchronously"
        )
    return None


def admissible(step: int, version: int, max_staleness: int) -> bool:
    """Whether the worker may start training step ``step``'s episodes while its weights have ``version``."""
    return step <= version + max_staleness


@dataclass
class _Batch:
    """The episodes of one training step."""

    step: int
    trajs: list[Trajectory]
    admitted_version: int
    stats: RolloutStats = field(default_factory=RolloutStats)
    taken: list[int] = field(default_factory=list)
    live: int = 0
    t0: float = field(default_factory=time.perf_counter)


def batch_metrics(batch: _Batch, step: int, waited: float) -> dict[str, float]:
    """A consumed step's metrics: its rollout statistics, how stale its tokens are against the trainer's version
    ``step``, the trainer's wait for it (``waited`` seconds) and the starvation diagnostics."""
    versions = [[v for s in t.segments if s.versions for v in s.versions] for t in batch.trajs]
    ages = [step - v for vs in versions for v in vs]
    oldest = [step - min(vs) for vs in versions if vs]
    return {
        **batch.stats.metrics(),
        "async/staleness_mean": Mean(sum(ages), len(ages)),  # versions behind the trainer, per token
        "async/staleness_max": Max(max(ages, default=0)),
        "async/episode_staleness_mean": Mean(sum(oldest), len(oldest)),  # of each episode's oldest token
        "async/admitted_lag": Max(step - batch.admitted_version),  # versions between start and training
        "async/wait_s": Max(waited),  # the trainer waiting for this step's longest episode
        "async/episode_age_s": Max(time.perf_counter() - batch.t0),  # admission to training
        **starvation(batch.trajs, oldest_of=[step - min(vs) if vs else 0 for vs in versions]),
    }


def worker_metrics(busy: float, tokens: int, reported: float) -> tuple[dict[str, float], float]:
    """Over the run so far (a worker ahead of the trainer may have been idle since the last step): the worker's
    generated tokens per second of its own busy time, summed over the processes' workers, and its busy seconds
    since the last step (``reported``: its busy time then). Returns the metrics and the busy time now."""
    return {
        "async/worker_tokens_per_s": Sum(tokens / max(busy, 1e-9)),
        "async/worker_busy_s": Max(busy - reported),
    }, busy


def starvation(trajs: list[Trajectory], oldest_of: list[int]) -> dict[str, float]:
    """Whether long episodes wait longer or are left out (peers' bug: tinker-cookbook #822, verl #6780): by
    the episode's number of actions (1, 2, 3+), the share of the step's episodes that finished and are
    trained on, and the staleness of their oldest token. Combined over processes as means."""
    out: dict[str, float] = {}
    buckets: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        n = len(t.steps)
        buckets.setdefault("3+" if n >= 3 else str(n), []).append(i)
    for name, idx in sorted(buckets.items()):
        done = sum(bool(st is not None and st.done) for st in (trajs[i].state for i in idx))
        out[f"async/completed_frac/{name}_actions"] = Mean(done, len(idx))
        out[f"async/episode_staleness/{name}_actions"] = Mean(sum(oldest_of[i] for i in idx), len(idx))
    return out


class AsyncRollout:
    """Episodes of step ``step``'s questions, ``group_size`` per question, produced ahead by a worker thread
    on a copy of the policy. ``indices(step)`` gives the step's training items, ``examples`` the questions."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        generator: Any,
        env: SearchEnv,
        tokenizer: Any,
        params: SamplingParams,
        examples: Sequence[Example] | Mapping[int, Example],
        indices: Callable[[int], list[int]],
        group_size: int,
        max_total_tokens: int,
        max_staleness: int,
        start_step: int,
        end_step: int,
        window: int = WINDOW,
        shipped: list[str] | None = None,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(
                f"max_staleness must be at least 1 for asynchronous rollouts, got {max_staleness}"
            )
        # the sampler's own whole copy of the policy (`engine.worker_weights.whole_copy`; the trainer's weights move
        # under it), or None where the generator is an engine with its own weights (vLLM: `sync_with`)
        self.model = model.eval() if model is not None else None
        # the parameters `sync` receives after each optimizer step (the trainable ones; None: all)
        names = [n for n, _ in model.named_parameters()] if model is not None else []
        self.shipped = shipped if shipped is not None else names
        for p in self.model.parameters() if self.model is not None else ():
            p.requires_grad_(False)
        self.gen = generator  # with a ``stream``: an HF generator on ``model``, or a vLLM engine
        self.env, self.tok, self.params, self.examples = env, tokenizer, params, examples
        self.indices, self.group_size, self.max_total = indices, group_size, max_total_tokens
        self.max_staleness, self.next_step, self.end_step, self.window = (
            max_staleness,
            start_step,
            end_step,
            window,
        )
        self.version = start_step  # optimizer steps taken by the weights the worker samples with
        self._cond = threading.Condition()
        self._weights = threading.Lock()  # held by the worker for each decode step
        # a threading.Lock is not fair: without this the worker could re-take it step after step while the
        # trainer waits to ship its weights (seen under load: a whole action decoded before the sync)
        self._sync_waiting = threading.Event()
        self._done: dict[int, _Batch] = {}
        self._error: BaseException | None = None
        self._stop = False
        # the worker's own throughput: seconds it spent decoding and stepping the environment (not waiting for
        # the cap or the trainer's weights) and the action tokens it generated
        self.busy_s, self.tokens, self._reported_busy = 0.0, 0, 0.0
        self._thread = threading.Thread(target=self._run, name="searchrl-rollout", daemon=True)

    # ------------------------------------------------------------------------------------- trainer side
    def start(self) -> None:
        self._thread.start()

    def take(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Step ``step``'s finished episodes (blocking until its longest is done) and their metrics: the
        rollout statistics and how stale their tokens are against the trainer's version ``step``."""
        t0 = time.perf_counter()
        batch = self.wait(step)
        metrics = batch_metrics(batch, step, time.perf_counter() - t0)
        out, self._reported_busy = worker_metrics(self.busy_s, self.tokens, self._reported_busy)
        return batch.trajs, {**metrics, **out}

    def wait(self, step: int) -> _Batch:
        """Step ``step``'s finished batch, once its longest episode is done (the worker's failure raised)."""
        with self._cond:
            while step not in self._done and self._error is None:
                self._cond.wait(timeout=1.0)
                if not self._thread.is_alive() and step not in self._done and self._error is None:
                    raise RuntimeError(f"the rollout worker stopped before producing step {step}'s episodes")
            if self._error is not None:
                raise RuntimeError(f"the rollout worker failed: {self._error!r}") from self._error
            return self._done.pop(step)

    def sync(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Ship the trainer's weights after its optimizer step ``version`` (parameters by name: the trainable
        ones, `engine.worker_weights.gathered`) into the worker's copy: loaded between two decode steps; tokens
        sampled from then on carry ``version``."""
        assert self.model is not None, "this worker samples with an engine: sync_with its loader"
        model = self.model
        self.sync_with(lambda: load_into(model, weights), version)

    def sync_with(self, load: Callable[[], None], version: int) -> None:
        """``load()`` the weights of optimizer step ``version`` into whatever samples (the worker's copy, or
        a vLLM engine's `VLLMGenerator.sync`), between two decode steps of the worker."""
        self._sync_waiting.set()  # the worker yields the lock at its next decode-step boundary
        with self._weights:
            self._sync_waiting.clear()
            load()
            self.version = version
        with self._cond:
            self._cond.notify_all()

    def join(self) -> None:
        """Wait until the worker has produced every step up to ``end_step`` (or failed)."""
        self._thread.join()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------------------------- worker side
    def _admit(self, stream: Any, batches: dict[int, _Batch]) -> None:
        """Start every step the cap allows: step j once the weights have version ≥ j − max_staleness."""
        while self.next_step < self.end_step and admissible(self.next_step, self.version, self.max_staleness):
            j, idx = self.next_step, self.indices(self.next_step)
            trajs = start_trajectories(self.env, self.tok, [self.examples[i] for i in idx], self.group_size)
            for t in trajs:  # one group per question, ids as the synchronous collect gives them
                t.group_id = idx[t.group_id]
            b = batches[j] = _Batch(j, trajs, self.version, taken=[0] * len(trajs))
            for i in range(len(trajs)):
                self._submit(stream, b, i)
            self.next_step += 1
            if b.live == 0:
                self._complete(batches.pop(j))

    def _submit(self, stream: Any, b: _Batch, i: int) -> bool:
        t = b.trajs[i]
        if ready(t, self.env, self.tok, self.max_total, {}):
            stream.add((b.step, i), t.token_ids, min(self.params.max_new_tokens, self.max_total - len(t)))
            b.live += 1
            return True
        return False

    def _complete(self, b: _Batch) -> None:
        finish(b.trajs, b.stats, b.t0)
        with self._cond:
            self._done[b.step] = b
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            with self.gen.stream(self.params, versions=True) as stream:
                self._loop(stream)
        except BaseException as exc:  # surfaced to the trainer by `take`
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _loop(self, stream: Any) -> None:
        batches: dict[int, _Batch] = {}
        waiting: list[tuple[Hashable, Generation]] = []
        waited = 0
        while True:
            with self._cond:
                if self._stop:
                    return
                if not len(stream) and not waiting:
                    if self.next_step >= self.end_step and not batches:
                        return  # every step produced
                    if not admissible(self.next_step, self.version, self.max_staleness):
                        self._cond.wait(timeout=1.0)  # the cap: wait for the trainer's next weights
                        continue
            while self._sync_waiting.is_set():  # the trainer is shipping weights: let it in first
                time.sleep(0.0005)
            with self._weights:
                t0 = time.perf_counter()
                stream.version = self.version
                self._admit(stream, batches)
                if len(stream):
                    ended = stream.step()
                    self.tokens += sum(len(g.token_ids) for _, g in ended)
                    waiting += ended
                    waited += bool(waiting)
                self.busy_s += time.perf_counter() - t0
            if waiting and (waited > self.window or not len(stream)):
                t0 = time.perf_counter()
                self._step_env(stream, waiting, batches)
                self.busy_s += time.perf_counter() - t0
                waiting, waited = [], 0

    def _step_env(
        self, stream: Any, waiting: list[tuple[Hashable, Generation]], batches: dict[int, _Batch]
    ) -> None:
        """One batched environment step for the actions that ended, grouped by training step."""
        by_step: dict[int, list[tuple[int, Generation]]] = {}
        for key, g in waiting:
            step, row = cast(tuple[int, int], key)
            by_step.setdefault(step, []).append((row, g))
        for j, actions in by_step.items():
            b = batches[j]
            for i in step_env(actions, b.trajs, self.env, self.tok, b.stats, b.taken):
                b.live -= 1
                # an episode that ended, or has no room left (it ends with "length"), drops its cache
                if b.trajs[i].state.done or not self._submit(stream, b, i):  # type: ignore[union-attr]
                    self.gen.release([(j, i)])
            if b.live == 0:
                self._complete(batches.pop(j))
