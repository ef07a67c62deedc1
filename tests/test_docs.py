"""Every YAML block in the README and docs/ loads as an experiment (or a sweep), so the examples a user
copies are valid. A block is read as if saved in experiments/synthetic/ (its `base:` is relative there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from searchrl.app.experiment import check_arguments, load_experiment

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{doc.name}:{doc.read_text()[: m.start()].count(chr(10)) + 1}")
    for doc in DOCS
    for m in re.finditer(r"```yaml\n(.*?)```", doc.read_text(), re.S)
    for block in [m.group(1)]
]


@pytest.fixture(autouse=True)
def user_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples" / "custom_reward"))  # the README's `my_rewards`


def test_docs_have_yaml_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS)
def test_yaml_block_loads(block, tmp_path):
    data = yaml.safe_load(block)
    assert isinstance(data, dict)
    if "rewards" in data and set(data) == {"rewards"}:  # a fragment: merged into the quickstart
        data = {"base": "../quickstart.yaml", **data}
    if "base" in data:
        data["base"] = str((REPO / "experiments" / "synthetic" / data["base"]).resolve())
    path = tmp_path / "block.yaml"
    path.write_text(yaml.safe_dump(data))
    exp = load_experiment(path)
    check_arguments(exp, str(path))
