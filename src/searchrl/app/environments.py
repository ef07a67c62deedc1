"""The environment registry: ``env.protocol`` names an entry, and the entry builds the run's environment.

An entry is a function ``build(resources, chat_format) -> env`` (`searchrl.app.resources.Resources`: the run's
retriever, summarizer, model tokenizer and configuration; ``chat_format``: a `ChatFormat` to render with instead
of the model's, or None), registered with ``chat=True`` when its environment renders through the model's chat
template (then the tool protocol's checks apply: a chat prompt, the react design, tool specs, and the local
model is built with a chat template). Three are built in:

- ``tags``: `SearchEnv`, the papers' tags in the text (``<search>``, ``<answer>``);
- ``tools``: `ToolEnv`, the model's own tool-calling format;
- ``agent``: `AgentProgramEnv`, a user's program playing each episode through the policy endpoint.

A user's environment needs no registration: ``env.protocol: my_pkg.envs:build`` names a builder by dotted path
(imported from ``PYTHONPATH``); a ``chat = True`` attribute on it says it renders through the chat template.
Its environment has `SearchEnv`'s interface (``reset``, ``step_batch``, ``stop_strings``; docs/design.md §5), or
plays whole episodes itself (``play``, as `AgentProgramEnv`).
"""

from __future__ import annotations

from typing import Any

from searchrl.core.registry import Registry

ENVIRONMENTS: Registry[Any] = Registry("environment")


def renders_chat(protocol: str) -> bool:
    """Whether the environment ``protocol`` names renders through the model's chat template."""
    if ":" in protocol:
        return bool(getattr(ENVIRONMENTS.get(protocol), "chat", False))
    return bool(ENVIRONMENTS.meta(protocol).get("chat", False))


@ENVIRONMENTS.register("tags", chat=False)
def tags(resources: Any, chat_format: Any = None) -> Any:
    """The papers' tag protocol (`SearchEnv`); a chat prompt (``env.template``) renders through the template."""
    from searchrl.envs.search import SearchEnv
    from searchrl.envs.tags import CHAT_TEMPLATES

    e = resources.exp.env
    env = SearchEnv(
        resources.retriever,
        tags=e.tags,
        template=e.template,
        topk=e.topk,
        max_turns=e.max_turns,
        max_query_chars=e.max_query_chars,
        on_budget=e.on_budget,
        doc_max_words=e.doc_max_words,
        agent=e.agent,
        summarizer=resources.summarizer,
        chat=resources.chat_format if e.template in CHAT_TEMPLATES else None,
        doc_format=e.doc_format,
        query_separator=e.query_separator,
        max_parallel_queries=e.max_parallel_queries,
    )
    env.context = resources.context_folder
    return env


@ENVIRONMENTS.register("tools", chat=True)
def tools(resources: Any, chat_format: Any = None, kind: Any = None, **extra: Any) -> Any:
    """The model's own tool-calling format (`ToolEnv`, or ``kind``, a subclass taking ``extra``)."""
    from searchrl.envs.tool_env import ToolEnv
    from searchrl.envs.tool_specs import build_tools

    e = resources.exp.env
    env = (kind or ToolEnv)(
        resources.retriever,
        chat_format if chat_format is not None else resources.tool_chat_format,
        **extra,
        template=e.template,
        topk=e.topk,
        max_turns=e.max_turns,
        max_tool_calls=e.max_tool_calls,
        on_budget=e.on_budget,
        doc_max_words=e.doc_max_words,
        max_query_chars=e.max_query_chars,
        max_response_chars=e.tool_response_max_chars,
        truncate_side=e.tool_response_truncate,
        call_format=e.call_format,
    )
    env.set_tools(build_tools(e.tools, env, resources.mcp_connections))
    env.context = resources.context_folder
    return env


@ENVIRONMENTS.register("agent", chat=True)
def agent(resources: Any, chat_format: Any = None) -> Any:
    """A user's agent program (`AgentProgramEnv`): the tool environment, whose episodes the program plays."""
    from searchrl.rollout.agent_program import AgentProgramEnv

    a = resources.exp.env.agent_program
    if a is None:  # `validate` refuses it; built anyway, the environment says what is missing
        return tools(resources, chat_format, AgentProgramEnv)
    return tools(
        resources, chat_format, AgentProgramEnv, program=a.function, command=a.command, timeout=a.timeout,
        workers=a.workers, max_calls=a.max_calls,
    )  # fmt: skip
