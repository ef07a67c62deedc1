"""The configured tools (``env.tools``) as `Tool` objects: built-in ``search`` and ``open``, an MCP server's
tools, or a Python function named ``pkg.module:function``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from searchrl.core.errors import ConfigError
from searchrl.core.registry import import_path
from searchrl.envs.tools import Tool, function_tool, open_tool, search_tool

# each kind of tool and the arguments its spec takes (a Python function: "pkg.module:function")
ARGS: dict[str, tuple[str, ...]] = {
    "search": ("max_k",),
    "open": ("max_words",),
    "mcp": ("server", "include", "timeout"),
    "function": ("name",),
}


def check_tool_specs(specs: Sequence[Any], file: str | None = None) -> None:
    """Each spec names a known kind of tool and only the arguments it takes (no import, no connection)."""
    for i, spec in enumerate(specs):
        key = f"env.tools[{i}]"
        kind = "function" if ":" in spec.name else spec.name
        if kind not in ARGS:
            raise ConfigError(
                "unknown tool",
                file=file,
                key=f"{key}.name",
                value=spec.name,
                choices=[*(k for k in ARGS if k != "function"), "pkg.module:function"],
            )
        for arg in spec.args:
            if arg not in ARGS[kind]:
                raise ConfigError(
                    "unknown tool argument",
                    file=file,
                    key=f"{key}.args.{arg}",
                    value=arg,
                    choices=list(ARGS[kind]),
                )
        if kind == "mcp" and not spec.args.get("server"):
            raise ConfigError(
                "an MCP tool needs its server: a URL (streamable HTTP) or a command line (stdio)",
                file=file,
                key=f"{key}.args.server",
                hint='e.g. {name: mcp, args: {server: ["searchrl", "serve-retriever", "--mcp", "stdio", '
                '"--corpus", "c.jsonl"]}}',
            )


def build_tools(specs: Sequence[Any], env: Any, connections: dict[str, Any]) -> list[Tool]:
    """``specs``: `ToolSpec`s; ``env``: the `ToolEnv` (its retriever, top-k and document format);
    ``connections``: MCP connections by server, reused across calls (the runtime keeps them)."""
    check_tool_specs(specs)
    out: list[Tool] = []
    for i, spec in enumerate(specs):
        args = dict(spec.args)
        if spec.name == "search":
            out.append(search_tool(env.retriever, env.topk, env.format_docs, **args))
        elif spec.name == "open":
            out.append(open_tool(**args))
        elif spec.name == "mcp":
            out += _mcp_tools(args, connections)
        else:
            try:
                fn = import_path(spec.name)
            except Exception as exc:
                raise ConfigError(
                    f"cannot import the tool function: {exc}", key=f"env.tools[{i}].name", value=spec.name
                ) from None
            out.append(function_tool(fn, **args))
    return out


def _mcp_tools(args: dict[str, Any], connections: dict[str, Any]) -> list[Tool]:
    from searchrl.envs.mcp import MCPConnection

    server = args["server"]
    ident = server if isinstance(server, str) else "\0".join(server)
    if ident not in connections:
        connections[ident] = MCPConnection(server, float(args.get("timeout", 60.0)))
    return connections[ident].as_tools(args.get("include"))
