"""The trainer's weights for a rollout worker's own whole copy of the policy (asynchronous rollouts).

Each training process owns one worker (`searchrl.rollout.async_rollout`) that samples with a whole, plain copy
of the policy. Without DeepSpeed the copy is a deep copy of the process's module. Under DeepSpeed no process
can copy its module (ZeRO-3 holds a shard of each parameter and hooks every module), so the copy is loaded
again from the model's directory with DeepSpeed hidden (`models.load`), and filled from the trainer's
parameters gathered whole: every parameter once at the start, then after each optimizer step the trainable
ones only (with LoRA: the adapter; with a value head: it too). Under ZeRO-3 each such shipment is one
``deepspeed.zero.GatheredParameters`` over the shipped parameters, a collective that every process enters at
the same point of its step (all processes step together), as the trainer's own gathers for generation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from searchrl.models.weights import load_into


@contextmanager
def gathered(engine: Any, model: Any, names: list[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """``model``'s parameters ``names`` (None: all), whole and detached, for reading inside the block. Under
    ZeRO-3 they are gathered on entry with one collective, so every process must enter at the same point;
    otherwise they are the module's own tensors."""
    module = engine.unwrap(model)
    params = dict(module.named_parameters())
    missing = [n for n in names or () if n not in params]
    if missing:
        raise KeyError(f"the policy has no parameter(s) {missing[:3]}")
    chosen = {n: params[n] for n in names} if names is not None else params
    if engine.is_deepspeed and engine.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(chosen.values()), modifier_rank=None):
            yield {n: p.data.detach() for n, p in chosen.items()}
    else:
        yield {n: p.detach() for n, p in chosen.items()}


def whole_copy(engine: Any, model: Any, load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A whole, plain copy of the policy for this process's rollout worker, on the training device, with the
    trainer's current weights. ``load`` builds the same architecture whole (DeepSpeed hidden) when the module
    cannot be deep-copied (any DeepSpeed stage); a collective then, entered by every process."""
    if not engine.is_deepspeed:
        return copy.deepcopy(engine.unwrap(model))
    worker = load().to(engine.device)
    with gathered(engine, model) as weights:
        load_into(worker, weights)
    return worker
