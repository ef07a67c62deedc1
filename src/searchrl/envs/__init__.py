"""Environments: the shared `SearchEnv`, tag protocols, retrievers and the synthetic world.

Names are imported on first use, so that a retrieval server (`searchrl.envs.retrievers`) does not load
torch, which `SearchEnv` needs (~200 MB resident)."""

from importlib import import_module
from typing import Any

_WHERE = {
    "EnvState": "searchrl.envs.search",
    "SearchEnv": "searchrl.envs.search",
    "StepInfo": "searchrl.envs.search",
    "TAGSETS": "searchrl.envs.tags",
    "TEMPLATES": "searchrl.envs.tags",
    "TagSet": "searchrl.envs.tags",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'searchrl.envs' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)


__all__ = ["TAGSETS", "TEMPLATES", "EnvState", "SearchEnv", "StepInfo", "TagSet"]
