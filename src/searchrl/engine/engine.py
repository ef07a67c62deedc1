"""The only module that touches accelerate and DeepSpeed: processes, prepare, backward, step, gather.

Works unchanged on one CPU, `accelerate launch` with DDP (CPU or GPU) and DeepSpeed ZeRO-2/3. On CPU the
process group must use gloo: without `InitProcessGroupKwargs(backend="gloo")` accelerate reports a single
process under DeepSpeed and the first gather fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def distributed_state() -> Any:
    """accelerate's process state, initialised the way `Engine` needs it (gloo on CPU). The first
    initialisation fixes the process group for the whole process, so it goes through an `Accelerator`
    (which also picks up DeepSpeed from `accelerate launch`) rather than a bare `PartialState()`."""
    from accelerate import Accelerator, PartialState

    if not PartialState._shared_state:
        Accelerator(kwargs_handlers=_process_group_kwargs())
    return PartialState()


def _process_group_kwargs() -> list[Any]:
    """gloo when launched on CPU: without it accelerate reports one process under DeepSpeed."""
    import os

    from accelerate.utils import InitProcessGroupKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []


class Engine:
    def __init__(self, grad_accum: int = 1, micro_batch_size: int = 1, max_grad_norm: float | None = 1.0,
                 mixed_precision: str = "no", seed: int = 0) -> None:  # fmt: skip
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        distributed_state()
        self.accelerator = Accelerator(
            gradient_accumulation_steps=grad_accum,
            mixed_precision=mixed_precision,
            kwargs_handlers=_process_group_kwargs(),
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
        """The plain module with every parameter present (gathered once under ZeRO-3, so that processes
        whose rollouts differ in length never wait on each other inside generation)."""
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(model, self.accelerator) as m:
            yield m

    # ----------------------------------------------------------------------------- optimisation
    @contextmanager
    def accumulate(self, model: Any) -> Iterator[None]:
        with self.accelerator.accumulate(model):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss`` is this process's share of the *global* loss (see `functional.token_weights`). DDP and
        DeepSpeed average gradients over processes and accelerate divides by the accumulation steps, so
        both are undone here: the summed gradient is that of the global loss."""
        if not torch.isfinite(loss):
            raise NonFiniteError(f"loss is {loss.item()}")
        self.accelerator.backward(loss * self.world_size * self.grad_accum)

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
    def sum(self, value: float | torch.Tensor) -> float:
        t = torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(1)
        return (
            float(self.accelerator.reduce(t, reduction="sum").item())
            if self.world_size > 1
            else float(t.item())
        )

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
