"""searchrl: train and compare LLM search agents with RL and process supervision on one shared base.

The package's layers, each a folder: ``app`` (command line, runs, evaluation, sweeps, reports, the viewer,
servers) over ``engine`` (training loop, accelerate/DeepSpeed) over ``algorithms`` over ``rewards`` over
``rollout`` over ``envs`` over ``models``, on ``core`` (config schema, types, tensor maths, statistics,
answers, errors) and ``data``. What a user needs is importable from here, lazily, so ``import searchrl``
stays light::

    from searchrl import load_experiment, train, evaluate, register_reward, RewardOutput, Trajectory
"""

from __future__ import annotations

import importlib
import logging as _logging
from typing import Any

__version__ = "0.1.0"

# the public API: name -> the module that defines it (imported on first use)
_API = {
    "load_experiment": "searchrl.app.experiment",
    "Experiment": "searchrl.core.config",
    "train": "searchrl.app.train",
    "evaluate": "searchrl.app.evaluate",
    "view": "searchrl.app.viewer.build",
    "register_reward": "searchrl.rewards",
    "RewardOutput": "searchrl.rewards",
    "Trajectory": "searchrl.core.types",
    "Segment": "searchrl.core.types",
    "Step": "searchrl.core.types",
    "Example": "searchrl.core.records",
    "Hop": "searchrl.core.records",
    "Doc": "searchrl.core.records",
    "exact_match": "searchrl.core.answers",
    "f1_score": "searchrl.core.answers",
    "Trainer": "searchrl.engine.trainer",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'searchrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


def _not_cpu_fallback_notice(record: _logging.LogRecord) -> bool:
    # DeepSpeed (imported by accelerate and trl) warns on every CPU-only import that it "was unable to detect"
    # a GPU; on a CPU machine that is expected and nothing a user can act on. Its other messages pass.
    return not record.getMessage().startswith("Setting accelerator to CPU.")


_logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback_notice)
