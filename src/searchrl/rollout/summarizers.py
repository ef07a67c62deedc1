"""The summarizer registry (``env.summarizer.name``): ``extract`` (no model, `searchrl.envs.summarize`) and
``llm`` (a chat model, `searchrl.rollout.chat`). It sits in the rollout layer, where the chat models are, so
that no registry string points up past the layer that registers it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from searchrl.core.registry import Registry

SUMMARIZERS: Registry[Callable[..., Any]] = Registry("summarizer")
SUMMARIZERS.add_lazy("extract", "searchrl.envs.summarize:ExtractiveSummarizer")
SUMMARIZERS.add_lazy("llm", "searchrl.rollout.chat:LLMSummarizer")
