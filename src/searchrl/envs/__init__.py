"""Environments: the shared `SearchEnv`, tag protocols, retrievers and the synthetic world."""

from searchrl.envs.search import EnvState, SearchEnv, StepInfo
from searchrl.envs.tags import TAGSETS, TEMPLATES, TagSet

__all__ = ["TAGSETS", "TEMPLATES", "EnvState", "SearchEnv", "StepInfo", "TagSet"]
