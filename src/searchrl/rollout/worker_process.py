"""A rollout worker in a process of its own (``trainer.async_rollout.worker: process``).

The asynchronous rollout worker of `searchrl.rollout.async_rollout` (the staleness cap, partial rollouts, each
token's version, the continuous batch) runs in a child process that builds its own environment (the
experiment's), its own copy of the policy (loaded as the trainer loads it, then filled with the trainer's
weights) and the experiment's generator: HF on that copy, or a vLLM engine that the worker starts (the
training process then starts none) and loads from that copy after every sync (LoRA merged). The worker is
a world of one process: an engine in it does not join the trainer's process group. The trainer's side,
`ProcessRollout`, has `AsyncRollout`'s interface (``start``, ``take``, ``sync``, ``close``), so the trainer
drives either the same way:

- **weights**: the shipped parameters (the trainable ones: the adapter with LoRA) live in tensors that both
  processes map (shared memory; CUDA tensors through CUDA IPC). ``sync`` copies the trainer's weights into
  them and returns once the worker has loaded them between two of its decode steps, so the buffers are
  never written while the worker reads them. The first fill (every parameter) goes the same way, once.
  With vLLM the worker's copy holds one more whole copy of the weights beside the engine's.
- **episodes**: each step's finished batch comes back pickled through a queue with the worker's busy time
  and generated tokens; the trainer scores the rewards, as with a thread worker.

Why a process: a worker thread shares the trainer's interpreter lock, so the Python of its decode loop and
environment steps waits on the trainer's Python, and the trainer's on it; a process has its own interpreter,
its own torch threads (``worker_threads``) and can have its own cores (``worker_cpus``). What it costs: a
second copy of the environment (an in-process retriever's index is built again in the worker; an HTTP
retriever shares its server) and a start (imports, index, model) at the run's start and after a rollback.
The child is started with ``spawn`` (no fork of a process holding threads, a CUDA context or DeepSpeed's
process group) and leaves when the trainer does.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from searchrl.core.config import Experiment, LoraConfig
from searchrl.core.errors import SearchRLError
from searchrl.core.records import Example
from searchrl.core.types import Trajectory
from searchrl.models.weights import load_into
from searchrl.rollout.async_rollout import AsyncRollout, _Batch, batch_metrics, worker_metrics
from searchrl.rollout.generator import SamplingParams, generator_options


class RolloutWorkerDied(SearchRLError, RuntimeError):
    """The rollout worker process died (a signal, out of memory, a native crash) more often than
    ``trainer.async_rollout.max_restarts`` allows: one line for the user (the CLI exits 2); the run's
    checkpoints are untouched, so ``--resume`` continues from the last one."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}; the run's checkpoints are kept: continue with `searchrl train … --resume` (or raise "
            "trainer.async_rollout.max_restarts, or give the worker more memory)"
        )


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the worker process builds its side from (pickled once, at its start)."""

    resources: Any  # the experiment's fresh `Resources` (nothing built yet): its ``env()`` is the worker's environment
    exp: Experiment  # the generator's settings (rollout.batch_size, backend_args)
    model_path: str  # the policy's architecture and tokenizer, loaded as the trainer's (`load_policy`)
    dtype: str
    lora: LoraConfig | None
    value_head: bool
    detach_trunk: bool
    device: str
    examples: Mapping[int, Example]  # the training items this process's steps use, by index
    indices: tuple[tuple[int, ...], ...]  # this process's items of steps start_step … end_step − 1
    params: SamplingParams
    group_size: int
    max_total_tokens: int
    max_staleness: int
    start_step: int
    end_step: int
    shipped: tuple[str, ...]  # the parameters each sync carries
    threads: int | None = None  # torch threads (None: torch's default)
    cpus: tuple[int, ...] = ()  # cores to pin the process to (Linux); empty: the trainer's
    seed: int = 0
    version: int | None = None  # the weights' optimizer step at the start (a restart's); None: start_step


class ProcessRollout:
    """The trainer's side of a rollout worker process: `AsyncRollout`'s interface over two queues and shared
    weight buffers. ``weights``: the policy's whole parameters now (every one, read only inside the call)."""

    def __init__(self, spec: WorkerSpec, weights: Mapping[str, torch.Tensor], max_restarts: int = 0) -> None:
        """``max_restarts``: how many times a worker that dies (killed, out of memory, a crash in a native
        library) is started again (`_restart`) before the run stops with the reasons."""
        if spec.max_staleness < 1:
            raise ValueError(
                f"max_staleness must be at least 1 for asynchronous rollouts, got {spec.max_staleness}"
            )
        missing = [n for n in spec.shipped if n not in weights]
        if missing:
            raise KeyError(f"the policy has no parameter(s) {missing[:3]}")
        import torch.multiprocessing as mp

        self._ctx = ctx = mp.get_context("spawn")
        self.spec, self.shipped, self.version = spec, list(spec.shipped), spec.start_step
        self.max_restarts, self.restarts, self._exits = max_restarts, 0, []  # type: ignore[var-annotated]
        self._next_take = spec.start_step  # the next step the trainer takes
        self._pending_sync: int | None = None  # a sync sent, not yet acknowledged
        self._restart_version: int | None = (
            None  # a restarted worker's weights, counted synced at its "ready"
        )
        # clones: sharing a tensor moves its storage into shared memory, which must not happen to the trainer's
        self._initial: dict[str, torch.Tensor] | None = _shared({n: w for n, w in weights.items()})
        self._buffers = _shared({n: weights[n] for n in spec.shipped})
        _settle([*self._initial.values(), *self._buffers.values()])  # CUDA: copied before the worker reads
        self._commands: Any = ctx.Queue()
        self._results: Any = ctx.Queue()
        self._proc = ctx.Process(
            target=serve,
            args=(spec, self._initial, self._buffers, self._commands, self._results),
            name="searchrl-rollout-worker",
            daemon=True,
        )
        self._cond = threading.Condition()
        self._done: dict[int, _Batch] = {}
        self._synced = spec.start_step
        self._reply: Any = None
        self._error: str | None = None
        self._died: str | None = None  # how the worker process died, past its restarts
        self._closed = False
        self.busy_s, self.tokens, self._reported_busy = 0.0, 0, 0.0
        self._receiver = threading.Thread(target=self._receive, name="searchrl-rollout-receiver", daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._receiver.start()

    def take(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """`AsyncRollout.take`: step ``step``'s finished episodes from the worker process, and their metrics."""
        t0 = time.perf_counter()
        with self._cond:
            self._await(lambda: step in self._done, f"step {step}'s episodes")
            batch = self._done.pop(step)
            self._next_take = step + 1
        metrics = batch_metrics(batch, step, time.perf_counter() - t0)
        out, self._reported_busy = worker_metrics(self.busy_s, self.tokens, self._reported_busy)
        out["async/worker_restarts"] = float(self.restarts)
        return batch.trajs, {**metrics, **out}

    def sync(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """`AsyncRollout.sync`: the trainer's weights after optimizer step ``version``, into the shared buffers,
        then loaded by the worker between two decode steps; returns once they are (the buffers are free)."""
        unknown = [n for n in weights if n not in self._buffers]
        if unknown:
            raise KeyError(f"parameter(s) {unknown[:3]} are not shipped to the worker process")
        with torch.no_grad():
            for n, w in weights.items():
                self._buffers[n].copy_(w)
        _settle(self._buffers.values())
        with self._cond:
            self._pending_sync = version
        self._commands.put(("sync", version))
        with self._cond:
            self._await(lambda: self._synced >= version, f"the weights of step {version}")
            self._pending_sync = None
        self.version = version

    def worker_weights(self) -> dict[str, torch.Tensor]:
        """The worker's copy of the policy, every parameter on the CPU (to check that syncs arrive)."""
        return dict(self._ask(("weights",), "its weights"))

    def worker_sample(self, prompt: list[int], params: SamplingParams) -> Any:
        """A `Generation` of ``prompt`` by the worker's sampler (a vLLM engine: its own weights), once the worker
        has produced every step: to check that the sampler holds the trainer's last weights."""
        return self._ask(("sample", list(prompt), params), "its sample")

    def _ask(self, cmd: tuple[Any, ...], what: str) -> Any:
        with self._cond:
            self._reply = None
        self._commands.put(cmd)
        with self._cond:
            self._await(lambda: self._reply is not None, what)
            reply, self._reply = self._reply, None
        return reply

    def close(self) -> None:
        self._closed = True
        if self._proc.is_alive():
            self._commands.put(("stop",))
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)
        if self._receiver.is_alive():
            self._receiver.join(timeout=5)
        for q in (self._commands, self._results):
            q.cancel_join_thread()
            q.close()

    # ------------------------------------------------------------------------------------- internals
    def _restart(self) -> None:
        """(Holding ``_cond``.) The worker died: start another on the steps not yet finished (those in flight
        are sampled again; finished ones already received are kept), from the shared buffers, which hold the
        weights of the last sync the trainer sent (the buffers hold every trainable parameter; the others
        are the model directory's). Counted synced once the new worker has loaded them."""
        first = self._next_take
        while first in self._done:
            first += 1
        version = max(self._synced, self._pending_sync if self._pending_sync is not None else self._synced)
        spec = _restart_spec(self.spec, min(first, self.spec.end_step), version, self.restarts + 1)
        self.restarts += 1
        self._restart_version = version
        # new queues: the dead process may have held a queue's lock (a pending sync command is not lost:
        # the new worker starts from the buffers, which already hold its weights)
        old = (self._commands, self._results)
        self._commands, self._results = self._ctx.Queue(), self._ctx.Queue()
        for q in old:
            q.cancel_join_thread()
        self._proc = self._ctx.Process(
            target=serve,
            args=(spec, dict(self._buffers), self._buffers, self._commands, self._results),
            name="searchrl-rollout-worker",
            daemon=True,
        )
        self._proc.start()
        self._cond.notify_all()

    def _await(self, ready: Any, what: str) -> None:
        """Wait (holding ``_cond``) until ``ready()``; a failed or vanished worker raises, naming ``what``: a
        worker that died (killed, out of memory) past its restarts as `RolloutWorkerDied`, one line for the
        user; a Python error in the worker as a RuntimeError with the worker's traceback (a bug to report)."""
        while not ready():
            if self._died is not None:
                raise RolloutWorkerDied(f"the rollout worker process {self._died} before {what}")
            if self._error is not None:
                raise RuntimeError(f"the rollout worker process failed before {what}:\n{self._error}")
            self._cond.wait(timeout=1.0)

    def _receive(self) -> None:
        """Messages from the worker into the trainer's state (a thread: the trainer never blocks on a queue)."""
        while not self._closed:
            try:
                msg = self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive() and not self._closed:
                    with self._cond:
                        self._exits.append(self._proc.exitcode)
                        if self._error is None and self.restarts < self.max_restarts:
                            self._restart()
                            continue
                        codes = ", ".join(str(c) for c in self._exits)
                        if self._error is None:
                            after = "" if len(self._exits) == 1 else f" after {self.restarts} restarts"
                            self._died = (
                                f"exited with code {codes} (killed, out of memory, or a crash in a native "
                                f"library){after} (trainer.async_rollout.max_restarts: {self.max_restarts})"
                            )
                            self._error = self._died
                        self._cond.notify_all()
                    return
                continue
            except (EOFError, OSError):
                return
            with self._cond:
                kind = msg[0]
                if kind == "batch":
                    _, step, batch, self.busy_s, self.tokens = msg
                    self._done[step] = batch
                elif kind == "ready":
                    self._initial = None  # the worker holds its own copy now
                    if self._restart_version is not None:  # a restarted worker loaded the buffers' weights
                        self._synced = max(self._synced, self._restart_version)
                        self._restart_version = None
                elif kind == "synced":
                    self._synced = max(self._synced, msg[1])
                elif kind in ("weights", "sample"):
                    self._reply = msg[1]
                elif kind == "error":
                    self._error = msg[1]
                self._cond.notify_all()


def _restart_spec(spec: WorkerSpec, first: int, version: int, restarts: int) -> WorkerSpec:
    """The spec of a worker started again: the steps from ``first`` on, weights of step ``version``."""
    from dataclasses import replace

    return replace(
        spec,
        start_step=first,
        indices=spec.indices[first - spec.start_step :],
        version=version,
        seed=spec.seed + 7919 * restarts,
    )


def _shared(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached clones the worker process maps: in shared memory (CPU) or shared through CUDA IPC."""
    out = {}
    for n, w in weights.items():
        c = w.detach().clone()
        out[n] = c.share_memory_() if c.device.type == "cpu" else c
    return out


def _settle(tensors: Any) -> None:
    """Wait for this process's pending copies into CUDA tensors that the other process reads (CUDA runs them
    asynchronously on this process's stream); nothing on a CPU."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)


# ----------------------------------------------------------------------------------------------- worker side
def serve(
    spec: WorkerSpec,
    initial: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    commands: Any,
    results: Any,
) -> None:
    """The worker process: build the environment and the policy's copy, run `AsyncRollout`, send each step's
    batch as it finishes, and load the trainer's weights from ``buffers`` when told to."""
    try:
        if spec.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(spec.cpus))
        if spec.threads:
            torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        _own_world(spec.device)
        side = _build(spec, initial)
        _settle(initial.values())
        # emptied, not just dropped: the process object's arguments hold the same dict, and a CUDA tensor shared
        # by the trainer stays allocated there (in PyTorch's limbo for sent blocks) until every receiver has
        # let go of it; the child ends with os._exit, which runs no destructors
        initial.clear()
        results.put(("ready",))
        side.rollout.start()
    except BaseException:
        results.put(("error", traceback.format_exc()))
        return
    rollout = side.rollout
    sender = threading.Thread(target=_send, args=(rollout, spec, results), daemon=True)
    sender.start()
    parent = os.getppid()
    try:
        while True:
            try:
                cmd = commands.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone
                    return
                continue
            if cmd[0] == "sync":
                side.load(buffers, cmd[1])
                _settle(buffers.values())  # read before the trainer may write the buffers again
                results.put(("synced", cmd[1]))
            elif cmd[0] == "weights":
                results.put(
                    ("weights", {n: p.detach().cpu().clone() for n, p in side.model.named_parameters()})
                )
            elif cmd[0] == "sample":
                results.put(("sample", _sample(side, cmd[1], cmd[2])))
            elif cmd[0] == "stop":
                return
    except BaseException:
        results.put(("error", traceback.format_exc()))
    finally:
        rollout.close()
        buffers.clear()  # released before os._exit (as ``initial`` above): the trainer's blocks can be freed


@dataclass
class _Side:
    """The worker's side: its rollout loop, the policy's copy the trainer's weights load into, and the sampler."""

    rollout: AsyncRollout
    model: torch.nn.Module
    gen: Any
    own_weights: bool  # the sampler holds weights of its own (vLLM), loaded from ``model``

    def load(self, buffers: Mapping[str, torch.Tensor], version: int) -> None:
        """The trainer's weights of optimizer step ``version`` into the copy, and from it into an engine that
        holds its own (vLLM: gathered from the copy, LoRA merged; the prefixes of requests in flight kept),
        between two of the worker's decode steps."""

        def load() -> None:
            load_into(self.model, buffers)
            if self.own_weights:
                self.gen.sync(reset_prefix_cache=False)

        self.rollout.sync_with(load, version)


def _build(spec: WorkerSpec, initial: Mapping[str, torch.Tensor]) -> _Side:
    from searchrl.models.policy import load_policy
    from searchrl.rollout.generator import GENERATORS

    exp = spec.exp
    env = spec.resources.env()
    model, tokenizer = load_policy(spec.model_path, spec.dtype, spec.lora, spec.value_head, spec.detach_trunk)
    model = model.to(spec.device).requires_grad_(False)
    load_into(model, initial)
    # the HF backend samples with this copy; vLLM starts its engine here (from the model directory) and loads
    # the copy's weights into it before its first step and after each of the trainer's syncs
    gen = GENERATORS.get(exp.rollout.backend)(
        model,
        tokenizer,
        env.stop_strings,
        batch_size=exp.rollout.batch_size,
        continuous=True,
        **generator_options(exp.rollout),
    )
    own_weights = hasattr(gen, "start")  # an engine (vLLM) that holds a copy of the weights of its own
    rollout = AsyncRollout(
        None if own_weights else model,
        gen,
        env,
        tokenizer,
        spec.params,
        spec.examples,
        lambda step: list(spec.indices[step - spec.start_step]),
        spec.group_size,
        spec.max_total_tokens,
        spec.max_staleness,
        start_step=spec.start_step,
        end_step=spec.end_step,
        shipped=list(spec.shipped),
    )
    if spec.version is not None:  # a restarted worker: its weights are a later step's than its first step
        rollout.version = spec.version
    if own_weights:
        gen.start()
    return _Side(rollout, model.eval(), gen, own_weights)


def _own_world(device: str) -> None:
    """The worker is a world of one process: an engine started in it (vLLM's, which reads the torchrun
    variables it inherits from a trainer under ``accelerate launch``) must not join the trainer's process
    group. ``LOCAL_RANK``: the trainer's device index, the one the engine uses."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = torch.device(device).index or 0
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # else it would join torchrun's store as a client
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK=str(index),
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _sample(side: _Side, prompt: list[int], params: SamplingParams) -> Any:
    """A generation by the worker's sampler once its rollout loop has produced every step (nothing else in
    flight on it): the check that the sampler, the engine included, holds the trainer's last weights."""
    side.rollout.join()
    [g] = side.gen.generate([prompt], params)
    return g


def _send(rollout: AsyncRollout, spec: WorkerSpec, results: Any) -> None:
    """Each step's batch to the trainer as soon as it is complete, in order."""
    try:
        for step in range(spec.start_step, spec.end_step):
            batch = rollout.wait(step)
            results.put(("batch", step, batch, rollout.busy_s, rollout.tokens))
    except BaseException:
        results.put(("error", traceback.format_exc()))
