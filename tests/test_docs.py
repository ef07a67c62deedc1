"""Every YAML block in the README and docs/ loads as an experiment (or a sweep), so the examples a user
copies are valid; every `searchrl …` command of a bash block parses against the CLI (its subcommand and
flags). A block is read as if saved in experiments/synthetic/ (its `base:` is relative there), or at the
repository's root when its base is a path from there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from searchrl.app.experiment import check_arguments, load_experiment

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{doc.name}:{doc.read_text()[: m.start()].count(chr(10)) + 1}")
    for doc in DOCS
    for m in re.finditer(r"```yaml\n(.*?)```", doc.read_text(), re.S)
    for block in [m.group(1)]
]


@pytest.fixture(autouse=True)
def user_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples" / "custom_reward"))  # the README's `my_rewards`
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agents"))  # docs/agents.md's `openai_search_agent`


def test_docs_have_yaml_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS)
def test_yaml_block_loads(block, tmp_path):
    data = yaml.safe_load(block)
    assert isinstance(data, dict)
    if "rewards" in data and set(data) == {"rewards"}:  # a fragment: merged into the quickstart
        data = {"base": "../quickstart.yaml", **data}
    if "base" in data:
        from_root = REPO / data["base"]
        data["base"] = str(
            from_root if from_root.exists() else (REPO / "experiments" / "synthetic" / data["base"]).resolve()
        )
    path = tmp_path / "block.yaml"
    if {"grid", "variants"} & set(data):  # a sweep file: its runs load and validate (`searchrl sweep`)
        from searchrl.app.sweep import check, load_sweep

        for var in data.get("variants") or []:
            if var.get("config"):
                var["config"] = str((REPO / "experiments" / "synthetic" / var["config"]).resolve())
        path.write_text(yaml.safe_dump(data))
        check(load_sweep(path, tmp_path))
        return
    path.write_text(yaml.safe_dump(data))
    exp = load_experiment(path)
    check_arguments(exp, str(path))


COMMANDS = [
    pytest.param(line, id=f"{doc.name}:{doc.read_text()[: m.start()].count(chr(10)) + 1}")
    for doc in DOCS
    for m in re.finditer(r"```bash\n(.*?)```", doc.read_text(), re.S)
    for line in m.group(1).replace("\\\n", " ").splitlines()
    if re.match(r"^\s*(\S+=\S+\s+)*(searchrl |accelerate launch .*-m searchrl |.*&& searchrl )", line)
]


def test_docs_have_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("line", COMMANDS)
def test_command_parses_against_the_cli(line):
    """The command's subcommand and flags exist (parsed, not run): a renamed flag or command fails here."""
    import shlex

    from searchrl.app.cli import build_parser

    words = shlex.split(line.split("&&")[-1].split("#")[0])
    at = words.index("searchrl") if "searchrl" in words else words.index("-m") + 1
    argv = words[at + 1 :]
    if argv[:1] == ["launch"]:  # accelerate's options (its own parser), then a searchrl command
        from accelerate.commands.launch import launch_command_parser

        from searchrl.app.launch import split_command

        accelerate_args, argv = split_command(argv[1:])
        _, unknown = launch_command_parser().parse_known_args([*accelerate_args, "-m", "searchrl"])
        assert not unknown, f"unknown accelerate launch options: {unknown}"
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    assert all("=" in x and not x.startswith("-") for x in extra), f"unknown arguments: {extra}"
    assert callable(getattr(args, "fn", None))


def test_the_configuration_reference_covers_the_schema():
    """The generated reference lists every key of every section, with the comment written beside it."""
    import dataclasses

    from searchrl.app.config_reference import markdown, rows
    from searchrl.core.config import Experiment

    keys = {r[0]: r for r in rows(Experiment)}
    assert {f.name for f in dataclasses.fields(Experiment)} <= set(keys)
    assert "rollout.compile" in keys and "env.tool_response_truncate" in keys
    assert "captured step" in keys["rollout.compile"][4] and keys["data.world.persons"][3] == "at least 0"
    page = markdown()
    assert page.count("## the file itself") == 1 and "`trainer.guards.on_trip`" in page
