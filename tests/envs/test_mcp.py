"""MCP: our retriever served as an MCP server over stdio (`searchrl serve-retriever --mcp stdio`), its tool
listed by the client and called by an episode of the tool protocol."""

from __future__ import annotations

import sys
import time

import pytest

from searchrl.core.config import ToolSpec
from searchrl.core.errors import ConfigError, DataError, SearchRLError
from searchrl.core.records import Example
from searchrl.envs.chat_format import ChatFormat
from searchrl.envs.tool_env import ToolEnv
from searchrl.envs.tool_specs import build_tools

from .test_tools import CountingRetriever, call

pytest.importorskip("mcp")


def our_server(fixtures) -> list[str]:
    """`searchrl serve-retriever --mcp stdio` over the fixture corpus."""
    return [
        sys.executable,
        "-m",
        "searchrl",
        "serve-retriever",
        "--mcp",
        "stdio",
        "--corpus",
        str(fixtures / "corpus.jsonl"),
    ]


@pytest.fixture(scope="module")
def connections(fixtures):
    server = our_server(fixtures)
    conns: dict = {}
    specs = [ToolSpec("mcp", {"server": server, "include": ["search"]})]
    yield specs, conns
    for c in conns.values():
        c.close()


def test_an_episode_lists_and_calls_an_mcp_servers_tool(connections, qwen_tok, fixtures):
    specs, conns = connections
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools")
    env.set_tools(build_tools(specs, env, conns))
    [tool] = env.tools.values()
    assert tool.name == "search" and tool.parameters["required"] == ["query"]
    assert tool.parameters["properties"]["k"]["type"] == "integer"
    state = env.reset(Example(id="q", question="Who?", answers=("x",)))
    assert '"name": "search"' in state.prompt  # the server's schema, rendered by the template
    from searchrl.data.corpus import load_corpus

    doc = load_corpus(fixtures / "corpus.jsonl")[0]
    query = " ".join(doc.text.split()[:8])
    obs, done, info = env.step(state, f"{call('search', query=query, k=2)}<|im_end|>", stopped=True)
    assert not done and info.valid and info.kind == "search" and info.calls == ("search",)
    assert f"[{doc.id}](Title: {doc.title})" in obs and "Doc 2 [" in obs and env.retriever.calls == []
    # a second environment on the same server reuses the connection
    again = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok))
    again.set_tools(build_tools(specs, again, conns))
    assert len(conns) == 1
    # the server's own argument check: its error comes back as the tool message
    obs, _, info = env.step(
        state, f"{call('search', query=query, k=2)}\n{call('search', query='')}<|im_end|>", stopped=True
    )
    assert obs.count("<tool_response>") == 2 and info.calls == ("search", "search")


def test_bad_tool_configs_are_refused(qwen_tok):
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok))
    with pytest.raises(ConfigError, match="env.tools\\[0\\].args.server"):
        build_tools([ToolSpec("mcp", {})], env, {})
    with pytest.raises(ConfigError, match="unknown tool"):
        build_tools([ToolSpec("browse")], env, {})
    with pytest.raises(ConfigError, match="env.tools\\[0\\].args.topk"):
        build_tools([ToolSpec("search", {"topk": 3})], env, {})
    with pytest.raises(ConfigError, match="cannot import"):
        build_tools([ToolSpec("no_such_module:fn")], env, {})
    [t] = build_tools([ToolSpec("tests.envs.test_tools:lookup_capital")], env, {})
    assert t.name == "lookup_capital"
    with pytest.raises(DataError, match="tool names must be unique|each name once"):
        env.set_tools(build_tools([ToolSpec("search"), ToolSpec("search")], env, {}))


def test_a_slow_or_failing_call_is_a_message_and_never_poisons_the_session(fixtures):
    """A call slower than the timeout, a tool that raises and arguments that are not JSON text each come
    back as an error for that call alone; the calls beside them and after them are answered."""
    from searchrl.envs.mcp import MCPConnection, _result

    conn = MCPConnection([sys.executable, str(fixtures / "mcp_tools_server.py")], timeout=2.0)
    try:
        got = conn.call([("slow", {"seconds": 5.0}), ("echo", {"text": "a"}), ("boom", {})])
        slow, fine, boom = (_result(r) for r in got)
        assert slow.error == "tool_error" and fine.text == "a" and fine.error is None
        assert boom.error == "tool_error" and "boom" in boom.text  # the server words its own error
        bad = _result(conn.call([("echo", {"text": "x\udfffy"})])[0])
        assert bad.error == "tool_error" and "not JSON text" in bad.text
        assert _result(conn.call([("echo", {"text": "after"})])[0]).text == "after"
    finally:
        conn.close()
    ended = conn.call([("echo", {"text": "closed"})])[0]
    assert isinstance(ended, ConnectionError)


def test_stdio_servers_inherit_the_trainers_environment_and_take_env_and_cwd(fixtures, tmp_path, monkeypatch):
    from searchrl.envs.mcp import MCPConnection, _result

    monkeypatch.setenv("SEARCHRL_FROM_TRAINER", "inherited")
    argv = [sys.executable, str(fixtures / "mcp_tools_server.py")]
    conn = MCPConnection(argv, timeout=20, env={"SEARCHRL_EXTRA": "given"}, cwd=str(tmp_path))
    try:
        got = conn.call(
            [("getenv", {"name": "SEARCHRL_FROM_TRAINER"}), ("getenv", {"name": "SEARCHRL_EXTRA"})]
        )
        assert [_result(r).text for r in got] == ["inherited", "given"]
    finally:
        conn.close()
    alone = MCPConnection(
        argv, timeout=20, env={"SEARCHRL_EXTRA": "given", "PATH": "/usr/bin:/bin"}, inherit_env=False
    )
    try:
        assert _result(alone.call([("getenv", {"name": "SEARCHRL_FROM_TRAINER"})])[0]).text == "<unset>"
    finally:
        alone.close()


def test_an_mcp_servers_file_and_the_documents_of_an_mcp_search(qwen_tok, fixtures, tmp_path):
    """A Claude-Desktop-style file names the servers; our serve-retriever's results are recorded as the
    call's documents (what `open`, recall and StepSearch's rewards read), and --max-topk bounds k."""
    import json

    from searchrl.data.corpus import load_corpus

    cfg = tmp_path / "servers.json"
    cmd = [str(fixtures / "corpus.jsonl")]
    cfg.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "library": {
                        "command": sys.executable,
                        "args": [
                            "-m",
                            "searchrl",
                            "serve-retriever",
                            "--mcp",
                            "stdio",
                            "--max-topk",
                            "2",
                            "--corpus",
                            *cmd,
                        ],
                    },
                    "other": {"command": sys.executable, "args": [str(fixtures / "mcp_tools_server.py")]},
                }
            }
        )
    )
    conns: dict = {}
    env = ToolEnv(CountingRetriever(), ChatFormat(qwen_tok), template="tools")
    try:
        env.set_tools(
            build_tools([ToolSpec("mcp", {"config": str(cfg), "servers": ["library"]})], env, conns)
        )
        assert list(env.tools) == ["search"]
        props = env.tools["search"].parameters["properties"]
        assert props["query"]["description"] == "what to search for" and "1 to 2" in props["k"]["description"]
        doc = load_corpus(fixtures / "corpus.jsonl")[0]
        state = env.reset(Example(id="q", question="Who?", answers=("x",)))
        query = " ".join(doc.text.split()[:8])
        _obs, _, info = env.step(state, f"{call('search', query=query, k=2)}<|im_end|>", stopped=True)
        assert info.valid and doc.id in info.doc_ids and len(info.doc_ids) == 2
        assert [d.id for d in state.retrieved[-1]] == list(info.doc_ids)
        # past --max-topk 2, below 1, or with an argument search does not take: refused with the reason
        for k in (5, -1):
            obs, _, info = env.step(state, f"{call('search', query=query, k=k)}<|im_end|>", stopped=True)
            assert info.failures == ("tool_error",) and "k" in obs and info.doc_ids == ()
        from searchrl.envs.mcp import _result

        [conn] = conns.values()
        extra = _result(conn.call([("search", {"query": query, "extra": 1})])[0])
        assert extra.error == "tool_error" and "extra" in extra.text
    finally:
        for c in conns.values():
            c.close()
    with pytest.raises(ConfigError, match="no such server"):
        build_tools([ToolSpec("mcp", {"config": str(cfg), "servers": ["nope"]})], env, {})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not an MCP servers file"):
        build_tools([ToolSpec("mcp", {"config": str(tmp_path / "bad.json")})], env, {})


def test_a_result_of_images_alone_says_so():
    from types import SimpleNamespace

    from searchrl.envs.mcp import _result

    r = SimpleNamespace(content=[SimpleNamespace(type="image", data="...")], is_error=False)
    out = _result(r)
    assert out.error == "non_text_result" and "image" in out.text and "text only" in out.text


def test_a_dead_server_is_reconnected_and_connecting_has_its_own_bound(fixtures, monkeypatch):
    """A server that takes longer to start than a call may take still connects (``connect_timeout``); after
    it dies, the next batch of calls opens a new session (at most every ``retry_every`` seconds)."""
    from searchrl.envs.mcp import MCPConnection, _result

    monkeypatch.setenv("SLOW_START", "2")
    conn = MCPConnection(
        [sys.executable, str(fixtures / "mcp_tools_server.py")],
        timeout=1.0,
        connect_timeout=60.0,
        retry_every=0.0,
    )
    try:
        assert _result(conn.call([("echo", {"text": "a"})])[0]).text == "a"
        died = _result(conn.call([("die", {})])[0])
        assert died.error == "tool_error"
        for _ in range(50):  # the client notices the ended session
            if conn._main.done():
                break
            time.sleep(0.1)
        back = _result(conn.call([("echo", {"text": "again"})])[0])
        assert back.text == "again" and conn.reconnects == 1
    finally:
        conn.close()
    monkeypatch.setenv("SLOW_START", "5")
    with pytest.raises(SearchRLError, match="within 1 s"):
        MCPConnection(
            [sys.executable, str(fixtures / "mcp_tools_server.py")], timeout=30.0, connect_timeout=1.0
        )


def test_our_servers_errors_keep_their_reason(fixtures):
    from searchrl.envs.mcp import MCPConnection, _result

    server = our_server(fixtures)
    conn = MCPConnection(server, timeout=30.0)
    try:
        long = _result(conn.call([("search", {"query": "x" * 5000})])[0])
        empty = _result(conn.call([("search", {"query": "   "})])[0])
        assert long.error == "tool_error" and "at most 4096" in long.text
        assert empty.error == "tool_error" and "empty" in empty.text
    finally:
        conn.close()


def test_max_queries_is_refused_with_mcp(fixtures, capsys):
    from searchrl.app.cli import main

    with pytest.raises(SystemExit):
        main(
            [
                "serve-retriever",
                "--mcp",
                "stdio",
                "--max-queries",
                "4",
                "--corpus",
                str(fixtures / "corpus.jsonl"),
            ]
        )
    assert "--max-queries bounds the queries of one HTTP request" in capsys.readouterr().err
