"""The environment registry (`searchrl.app.environments`): ``env.protocol`` names a built-in entry or a user's
builder by dotted path, and an unknown name is refused with the valid ones when the file is read."""

from __future__ import annotations

import textwrap

import pytest

from searchrl.app.environments import ENVIRONMENTS, renders_chat
from searchrl.app.experiment import load_experiment
from searchrl.core.errors import ConfigError

from .test_tools_train import tool_overrides

USER_ENV = """
from searchrl.app.environments import tools
from searchrl.envs.tool_env import ToolEnv


class CitingEnv(ToolEnv):
    def format_docs(self, docs):
        return "\\n".join(f"[{d.id}] {d.text}" for d in docs)


def build(resources, chat_format=None):
    return tools(resources, chat_format, CitingEnv)


build.chat = True
"""


def test_the_built_in_environments_and_what_they_render():
    assert ENVIRONMENTS.names() == ["agent", "tags", "tools"]
    assert [renders_chat(n) for n in ENVIRONMENTS.names()] == [True, False, True]


def test_an_unknown_protocol_is_refused_with_the_valid_names():
    with pytest.raises(ConfigError) as e:
        load_experiment(None, ["env.protocol=toolz"])
    assert e.value.key == "env.protocol" and "agent, tags, tools" in str(e.value) and "tools" in str(e.value)


def test_a_users_environment_by_dotted_path(tmp_path, world_dir, monkeypatch):
    """The docs' example (docs/design.md §5): a `ToolEnv` subclass with observations of its own, built by the
    registry's `tools` entry, named ``env.protocol: my_envs:build``."""
    from searchrl.app.resources import Resources
    from searchrl.core.records import Example

    (tmp_path / "my_envs.py").write_text(textwrap.dedent(USER_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [o for o in tool_overrides(world_dir, tmp_path / "run") if o != "env.protocol=tools"]
    exp = load_experiment(None, [*overrides, "env.protocol=my_envs:build"])
    assert renders_chat("my_envs:build")
    resources = Resources(exp)
    env = resources.env()
    assert type(env).__name__ == "CitingEnv"
    question = resources.examples("train")[0].question
    state = env.reset(Example("q", question, ("x",)))
    [(obs, done, info)] = env.step_batch([state], [env.write_search("look it up", question)])
    [doc] = state.retrieved[0]
    assert info.kind == "search" and not done and f"[{doc.id}] " in obs and "Doc 1" not in obs
