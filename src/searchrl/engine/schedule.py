"""What a step trains on and how: the items of each step (`Schedule`), the batch shape of one process
(`batch_shape`) and the optimizer with its learning-rate schedule (`make_optimizer`)."""

from __future__ import annotations

import random
from typing import Any

import torch

from searchrl.algorithms.base import Requirements
from searchrl.core.config import ConfigError, TrainerConfig
from searchrl.engine.precision import with_master_weights


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


def make_optimizer(
    cfg: TrainerConfig, groups: list[dict[str, Any]], master_weights: bool = False
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over ``groups`` and its learning-rate schedule (per update: steps × epochs × mini-batches).
    ``master_weights``: bfloat16 / float16 parameters stepped through float32 copies (`engine.precision`)."""
    from transformers import get_scheduler

    opt_cls: Any = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.SGD
    if master_weights:
        opt_cls = with_master_weights(opt_cls)
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
