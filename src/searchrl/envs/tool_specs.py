"""The configured tools (``env.tools``) as `Tool` objects: built-in ``search`` and ``open``, an MCP server's
tools, a Python function named ``pkg.module:function``, or a class named ``pkg.module:Class`` (one instance per
episode, its public methods the tools; `searchrl.envs.python_tools`). Every kind also takes ``description``
and ``parameters`` (replacing what was read from the tool), and Python tools ``timeout`` and
``max_concurrency``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from searchrl.core.errors import ConfigError
from searchrl.core.registry import import_path
from searchrl.envs.python_tools import class_tools, configured, function_tool
from searchrl.envs.tools import Tool, open_tool, search_tool

COMMON = ("description", "parameters")  # every kind: replaces what was read from the tool
# each kind of tool and the arguments its spec takes (Python: "pkg.module:function" or "pkg.module:Class";
# a class's constructor arguments go under kwargs)
ARGS: dict[str, tuple[str, ...]] = {
    "search": ("max_k", *COMMON),
    "open": ("max_words", *COMMON),
    # an MCP server: server (a URL or a command line) or config (a Claude-Desktop-style {"mcpServers": ...}
    # file) with servers (which of its entries; default all); env, cwd, inherit_env (stdio), headers (HTTP)
    "mcp": (
        "server",
        "config",
        "servers",
        "include",
        "timeout",
        "connect_timeout",
        "env",
        "cwd",
        "headers",
        "inherit_env",
    ),
    "function": ("name", "timeout", "max_concurrency", "kwargs", *COMMON),
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
        for arg, what in (
            ("timeout", "seconds"),
            ("connect_timeout", "seconds"),
            ("max_concurrency", "calls"),
        ):
            value = spec.args.get(arg)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if (
                arg in spec.args
                and not ok
                and not (value is None and arg == "timeout" and kind == "function")
            ):
                raise ConfigError(
                    f"must be a positive number of {what}"
                    + (
                        " (or null: a Python tool's calls unbounded, in the trainer's thread)"
                        if arg == "timeout"
                        else ""
                    ),
                    file=file,
                    key=f"{key}.args.{arg}",
                    value=value,
                )
        if kind == "mcp" and not spec.args.get("server") and not spec.args.get("config"):
            raise ConfigError(
                "an MCP tool needs its server: a URL (streamable HTTP) or a command line (stdio), or config: "
                'a file of {"mcpServers": {name: {command, args, env} or {url, headers}}}',
                file=file,
                key=f"{key}.args.server",
                hint='e.g. {name: mcp, args: {server: ["searchrl", "serve-retriever", "--mcp", "stdio", '
                '"--corpus", "c.jsonl"]}}',
            )


def build_tools(specs: Sequence[Any], env: Any, connections: dict[str, Any]) -> list[Tool]:
    """``specs``: `ToolSpec`s; ``env``: the `ToolEnv` (its retriever, top-k and document format);
    ``connections``: MCP connections by server, reused across calls (the run's resources keep them)."""
    check_tool_specs(specs)
    out: list[Tool] = []
    for i, spec in enumerate(specs):
        args = dict(spec.args)
        common = {k: args.pop(k) for k in COMMON if k in args and spec.name in ("search", "open")}
        if spec.name == "search":
            out.append(configured(search_tool(env.retriever, env.topk, env.format_docs, **args), **common))
        elif spec.name == "open":
            out.append(configured(open_tool(**args), **common))
        elif spec.name == "mcp":
            out += _mcp_tools(args, connections)
        else:
            out += _python_tools(spec.name, args, i, env.retriever)
    return out


def _python_tools(path: str, args: dict[str, Any], i: int, retriever: Any) -> list[Tool]:
    """A function or a class named ``pkg.module:attr``, with the spec's settings."""
    try:
        obj = import_path(path)
    except Exception as exc:
        raise ConfigError(
            f"cannot import the tool function: {exc}", key=f"env.tools[{i}].name", value=path
        ) from None
    common = {k: args.pop(k) for k in COMMON if k in args}
    bounds = {k: args.pop(k) for k in ("timeout", "max_concurrency") if k in args}
    if isinstance(obj, type):
        if "name" in args:
            raise ConfigError(
                "a tool class's tools are named by its methods", key=f"env.tools[{i}].args.name"
            )
        tools = class_tools(obj, path, args.pop("kwargs", {}), retriever=retriever, **bounds)
    else:
        if "kwargs" in args:
            raise ConfigError(
                "kwargs are a tool class's constructor arguments", key=f"env.tools[{i}].args.kwargs"
            )
        tools = [function_tool(obj, **args, **bounds)]
    if common and len(tools) > 1:
        raise ConfigError(
            "description and parameters replace one tool's; this class offers several",
            key=f"env.tools[{i}].args",
            value=sorted(common),
        )
    return [configured(t, **common) for t in tools]


def _mcp_tools(args: dict[str, Any], connections: dict[str, Any]) -> list[Tool]:
    """One server's tools, or those of every server (``servers``: the named ones) of a ``config`` file."""
    if args.get("config"):
        out: list[Tool] = []
        for entry in mcp_servers(args["config"], args.get("servers")):
            out += _mcp_tools(
                {**{k: v for k, v in args.items() if k not in ("config", "servers")}, **entry}, connections
            )
        return out
    from searchrl.envs.mcp import MCPConnection

    server = args["server"]
    ident = server if isinstance(server, str) else "\0".join(server)
    if ident not in connections:
        connections[ident] = MCPConnection(
            server,
            float(args.get("timeout", 60.0)),
            env=args.get("env"),
            cwd=args.get("cwd"),
            headers=args.get("headers"),
            inherit_env=bool(args.get("inherit_env", True)),
            connect_timeout=float(args.get("connect_timeout", 120.0)),
        )
    return connections[ident].as_tools(args.get("include"))


def mcp_servers(path: str, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The servers of a Claude-Desktop-style file, ``{"mcpServers": {name: {"command", "args", "env", "cwd"}
    or {"url", "headers"}}}``, as our MCP tool arguments (``server``, ``env``, ``cwd``, ``headers``)."""
    import json
    from pathlib import Path

    key = "env.tools[].args.config"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        servers = data["mcpServers"]
        assert isinstance(servers, dict)
    except FileNotFoundError:
        raise ConfigError("no such file", key=key, value=path) from None
    except (ValueError, KeyError, AssertionError, TypeError):
        raise ConfigError(
            'not an MCP servers file: expected {"mcpServers": {name: {...}}}', key=key, value=path
        ) from None
    unknown = [n for n in names or () if n not in servers]
    if unknown:
        raise ConfigError(
            "no such server in the file",
            key="env.tools[].args.servers",
            value=unknown[0],
            choices=list(servers),
        )
    out = []
    for name in names or list(servers):
        entry = servers[name]
        if not isinstance(entry, dict) or not (entry.get("command") or entry.get("url")):
            raise ConfigError(
                "a server entry needs command (stdio) or url (HTTP)", key=key, value=f"{path}: {name}"
            )
        server = entry["url"] if entry.get("url") else [entry["command"], *entry.get("args", [])]
        out.append(
            {"server": server, **{k: entry[k] for k in ("env", "cwd", "headers") if entry.get(k) is not None}}
        )
    return out
