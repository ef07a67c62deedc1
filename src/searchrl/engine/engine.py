"""The only module that touches accelerate and DeepSpeed: processes, prepare, backward, step, gather.

Works unchanged on one CPU, `accelerate launch` with DDP (CPU or GPU) and DeepSpeed ZeRO-2/3. On CPU the
process group must use gloo: without `InitProcessGroupKwargs(backend="gloo")` accelerate reports a single
process under DeepSpeed and the first gather fails.

Every process must issue the same collectives in the same order whatever its data (rollouts differ per
process): metrics are reduced over a key set all processes agree on (`reduce_metrics`), parameters are
gathered once per rollout rather than once per generation call (`for_generation`), and every process
trains on the same number of rows (the trainer pads). A collective that waits longer than the configured
timeout (``distributed.timeout``) fails with `CollectiveTimeout`, naming the step and phase (`phase`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from searchrl.core.aggregate import Report, finish, flatten, kind_of, layout
from searchrl.core.errors import SearchRLError

# Deprecations inside our dependencies, nothing a user can act on: trl's generation helper reads a property
# and (with model.gradient_checkpointing) calls methods transformers 5.2x renamed; DeepSpeed ZeRO-3 calls
# torch.distributed collectives torch 2.13 renamed (every step)
warnings.filterwarnings(
    "ignore",
    message=r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated",
    category=FutureWarning,
)
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning,
)

CPU_TIMEOUT_S = 300.0  # a few minutes: a CPU run's processes never legitimately wait longer on each other
GPU_TIMEOUT_S = 1800.0  # long generations and checkpoint writes of large models on GPUs
SETUP_TIMEOUT_S = 6 * 3600.0  # the main process builds worlds, models and data while the others wait

_TIMEOUT_S: float | None = None  # what the process group was initialised with
_SETUP_GROUP: Any = None  # a gloo group with a long timeout, for waits on known long main-process work


def default_timeout() -> float:
    return GPU_TIMEOUT_S if torch.cuda.is_available() else CPU_TIMEOUT_S


def collective_timeout() -> float:
    """Seconds a collective may wait for the other processes in this run."""
    return _TIMEOUT_S if _TIMEOUT_S is not None else default_timeout()


def distributed_state(timeout: float | None = None) -> Any:
    """accelerate's process state, initialised the way `Engine` needs it (gloo on CPU, ``timeout``
    seconds per collective; default `default_timeout`). The first initialisation fixes the process
    group for the whole process, so it goes through an `Accelerator` (which also picks up DeepSpeed from
    `accelerate launch`) rather than a bare `PartialState()`."""
    global _TIMEOUT_S, _SETUP_GROUP
    from accelerate import Accelerator, PartialState

    if not PartialState._shared_state:
        _TIMEOUT_S = float(timeout) if timeout is not None else default_timeout()
        Accelerator(kwargs_handlers=_process_group_kwargs())
        state = PartialState()
        if state.num_processes > 1:
            import torch.distributed as dist

            _SETUP_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=SETUP_TIMEOUT_S))
    return PartialState()


def _adopt_mixed_precision(mixed_precision: str | None) -> None:
    """Let an `Accelerator` with ``mixed_precision`` be built after the process's first one.

    accelerate fixes the mixed precision of its process-wide state at the first `Accelerator`
    (`distributed_state`'s, which takes `accelerate launch`'s setting) and refuses a later one that asks for
    another, outside DeepSpeed. A run's stages may ask for different ones (a warm start in float32, RL in
    bfloat16), and a launcher's config may name one the experiment overrides; the accelerator state (not the
    process group) is then rebuilt. ``None``: the launcher's (``ACCELERATE_MIXED_PRECISION``), else ``no``."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if mixed_precision is None:
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if not AcceleratorState._shared_state:
        return
    acc = AcceleratorState()
    if acc.distributed_type != DistributedType.DEEPSPEED and str(acc.mixed_precision) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def _process_group_kwargs() -> list[Any]:
    """gloo when launched on CPU (without it accelerate reports one process under DeepSpeed), and the
    collective timeout."""
    from accelerate.utils import InitProcessGroupKwargs

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return []
    seconds = collective_timeout()
    if seconds == 600.0:  # accelerate drops a value equal to its own default (600 s, nccl): keep ours
        seconds += 1e-3
    kw: dict[str, Any] = {"timeout": timedelta(seconds=seconds)}
    if not torch.cuda.is_available():
        kw["backend"] = "gloo"
    return [InitProcessGroupKwargs(**kw)]


def wait_for_main(state: Any) -> None:
    """Barrier after work only the main process does (building a world, a model, teacher data): it may
    take longer than the collective timeout, so it waits on a group with a long one."""
    if state.num_processes <= 1:
        return
    import torch.distributed as dist

    dist.barrier(group=_SETUP_GROUP)


class CollectiveTimeout(SearchRLError, RuntimeError):
    """A collective did not complete in time: the processes ran different sequences of collectives, or
    one of them is stuck or died."""


def _is_distributed_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(exc, dist_error) or any(
        s in text for s in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
    )


class Engine:
    def __init__(
        self,
        grad_accum: int = 1,
        micro_batch_size: int = 1,
        max_grad_norm: float | None = 1.0,
        mixed_precision: str | None = None,
        seed: int = 0,
    ) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed

        distributed_state()
        _adopt_mixed_precision(mixed_precision)
        self._phase: tuple[str, int | None] = ("setup", None)
        self._generating: Any = None  # the gathered module while a rollout is under way
        self._nonfinite_loss: float | None = None
        self.accelerator = Accelerator(
            gradient_accumulation_steps=grad_accum,
            mixed_precision=mixed_precision,  # None: the launcher's
            kwargs_handlers=_process_group_kwargs(),
            # our batch sizes are global (`trainer.batch_size` is split over the processes), and so is the
            # schedule's step count: the prepared scheduler steps once per optimizer step. accelerate's default
            # (per-process batches) steps it once per process, which decayed the learning rate N times as fast
            # on N processes (`AcceleratedScheduler.step`)
            dataloader_config=DataLoaderConfiguration(split_batches=True),
        )
        self.max_grad_norm = max_grad_norm
        ds = self.accelerator.state.deepspeed_plugin
        if ds is not None:  # values our loop decides; "auto" cannot be resolved without a dataloader
            ds.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
            ds.deepspeed_config["gradient_accumulation_steps"] = grad_accum
            ds.deepspeed_config["gradient_clipping"] = max_grad_norm or 0.0
            ds.deepspeed_config.pop("train_batch_size", None)
            ds.deepspeed_config["zero_allow_untested_optimizer"] = True  # torch SGD is fine under ZeRO
            # checkpoints export a loadable HF model, which needs the full weights gathered
            ds.deepspeed_config.setdefault("zero_optimization", {})[
                "stage3_gather_16bit_weights_on_model_save"
            ] = True
        set_seed(seed, device_specific=False)

    # ----------------------------------------------------------------------------- facts
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def is_deepspeed(self) -> bool:
        return self.accelerator.state.deepspeed_plugin is not None

    @property
    def zero_stage(self) -> int:
        ds = self.accelerator.state.deepspeed_plugin
        return int(ds.zero_stage) if ds is not None else 0

    @property
    def grad_accum(self) -> int:
        return self.accelerator.gradient_accumulation_steps

    # ----------------------------------------------------------------------------- models
    def prepare(self, *objs: Any) -> Any:
        return self.accelerator.prepare(*objs)

    def prepare_frozen(self, model: Any) -> Any:
        """A frozen model (the full-fine-tuning reference) placed like the policy: initialised for
        DeepSpeed inference under ZeRO-3 (as TRL does), moved to the device otherwise."""
        if self.is_deepspeed and self.zero_stage == 3:
            from trl.models.utils import prepare_deepspeed

            return prepare_deepspeed(model, self.accelerator)
        return model.to(self.device)

    def unwrap(self, model: Any) -> Any:
        return self.accelerator.unwrap_model(model)

    @contextmanager
    def for_generation(self, model: Any) -> Iterator[Any]:
        """The plain module with every parameter present. Under ZeRO-3 the parameters are gathered on
        entry (a collective); nested entries reuse the gathered module, so a rollout whose processes
        take different numbers of turns (generation calls) gathers exactly once on every process."""
        if self._generating is not None:
            yield self._generating
            return
        from trl.models.utils import unwrap_model_for_generation

        # with model.gradient_checkpointing, trl turns checkpointing off for generation and back on after,
        # with these arguments (by default transformers before 5.2x would turn it back on reentrant)
        with unwrap_model_for_generation(
            model, self.accelerator, gradient_checkpointing_kwargs={"use_reentrant": False}
        ) as m:
            self._generating = m
            try:
                yield m
            finally:
                self._generating = None

    def for_no_grad(self, model: Any) -> Any:
        """The module to call for no-grad log-prob passes: under DDP the plain module (its forward
        broadcasts buffers, a collective per call that no-grad passes do not need); under ZeRO-3 the engine
        (its forward gathers the partitioned parameters)."""
        return model if self.is_deepspeed else self.unwrap(model)

    # ----------------------------------------------------------------------------- phases
    @contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Names what the processes are doing; a collective that times out inside raises
        `CollectiveTimeout` naming the step and this phase."""
        prev = self._phase
        self._phase = (name, step)
        try:
            yield
        except CollectiveTimeout:
            raise
        except Exception as exc:
            if self.world_size > 1 and _is_distributed_failure(exc):
                where = f"step {step + 1}, phase '{name}'" if step is not None else f"phase '{name}'"
                raise CollectiveTimeout(
                    f"{where}: process {self.rank} of {self.world_size} waited in a collective operation that "
                    f"did not complete within {collective_timeout():.0f} s (distributed.timeout). The processes "
                    "are out of step (they issued different sequences of collectives), or another process is "
                    f"stuck or died; see its error. Cause: {type(exc).__name__}: {str(exc)[:300]}"
                ) from exc
            raise
        finally:
            self._phase = prev

    # ----------------------------------------------------------------------------- optimisation
    @contextmanager
    def accumulate(self, model: Any) -> Iterator[None]:
        with self.accelerator.accumulate(model):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss`` is this process's share of the *global* loss (see `functional.token_weights`). DDP and
        DeepSpeed average gradients over processes and accelerate divides by the accumulation steps, so
        both are undone here: the summed gradient is that of the global loss.

        A non-finite loss is remembered, not raised: raising on this process alone would leave the others
        waiting in the gradient reduction. It makes the global gradient norm non-finite on every process,
        where the trainer stops them together (`take_nonfinite_loss` names the loss then)."""
        if not torch.isfinite(loss):
            self._nonfinite_loss = float(loss.detach())
        self.accelerator.backward(loss * self.world_size * self.grad_accum)

    def take_nonfinite_loss(self) -> float | None:
        """The last non-finite loss this process saw since the previous call, if any."""
        bad, self._nonfinite_loss = self._nonfinite_loss, None
        return bad

    @property
    def sync_gradients(self) -> bool:
        return self.accelerator.sync_gradients

    def clip_grad_norm(self, model: Any) -> float:
        if self.is_deepspeed:  # clipped inside engine.step (gradient_clipping in the config)
            norm = model.get_global_grad_norm()  # accelerate's prepare() returned the DeepSpeedEngine
            return float(norm) if norm is not None else float("nan")
        params = [p for p in model.parameters() if p.requires_grad]
        max_norm = self.max_grad_norm if self.max_grad_norm else float("inf")
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    # ----------------------------------------------------------------------------- communication
    @staticmethod
    def scale_lr(optimizer: Any, scheduler: Any, factor: float) -> None:
        """Multiply the learning rate by ``factor`` from now on: every parameter group's rate and the
        base rates the schedule is computed from (a prepared scheduler wraps the torch one)."""
        for group in optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        inner = getattr(scheduler, "scheduler", scheduler)
        inner.base_lrs = [lr * factor for lr in inner.base_lrs]

    def sum(self, value: float | torch.Tensor) -> float:
        t = torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(1)
        return (
            float(self.accelerator.reduce(t, reduction="sum").item())
            if self.world_size > 1
            else float(t.item())
        )

    def reduce_metrics(self, local: Report) -> dict[str, float]:
        """Every process's metrics combined (`searchrl.core.aggregate`): the same values on every process, equal
        to what one process would compute from the union of the data. Processes may report different keys:
        the key set is agreed first, then one flat tensor of sums and one of maxima are reduced, so the
        collectives are the same three whatever each process reported."""
        keys = layout(
            self.gather_objects([[(k, kind_of(v)) for k, v in local.items()]])
            if self.world_size > 1
            else [[(k, kind_of(v)) for k, v in local.items()]]
        )
        sums, maxes = flatten(local, keys)
        if self.world_size > 1:
            import torch.distributed as dist

            s = torch.tensor([*sums, 0.0], dtype=torch.float64, device=self.device)  # never empty
            m = torch.tensor([*maxes, 0.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(s, op=dist.ReduceOp.SUM)
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            sums, maxes = s[:-1].tolist(), m[:-1].tolist()
        return finish(keys, sums, maxes)

    def gather_objects(self, items: list[Any]) -> list[Any]:
        if self.world_size == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(items))

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def print(self, *args: Any) -> None:
        self.accelerator.print(*args)


class NonFiniteError(RuntimeError):
    """A NaN or inf loss or gradient: the step is abandoned and the last good checkpoint kept."""
