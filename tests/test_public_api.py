"""The public API (`from searchrl import …`): every documented name imports, `import searchrl` stays light,
the README's and the examples' imports use it and load, and the old deep paths still import, saying where
the module moved."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import searchrl

REPO = Path(__file__).resolve().parents[1]
DOCUMENTED = ["load_experiment", "train", "evaluate", "view", "register_reward", "RewardOutput", "Trajectory"]


@pytest.mark.parametrize("name", sorted(set(searchrl.__all__) | set(DOCUMENTED)))
def test_each_public_name_imports(name):
    value = getattr(searchrl, name)
    assert value is not None and name in dir(searchrl)
    module = importlib.import_module(searchrl._API[name])
    assert getattr(module, name) is value  # the object itself, not a copy


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        searchrl.nope  # noqa: B018


def test_import_searchrl_loads_no_torch():
    code = "import sys, searchrl; print('torch' in sys.modules, 'searchrl.app.train' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _imports(source: str) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)]


def _ours(node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""] if (node.module or "").startswith("searchrl") else []
    return [a.name for a in node.names if a.name.startswith("searchrl")]


def _user_code() -> dict[str, str]:
    """The Python a user is shown: the README's python blocks and the examples' modules."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = {f"README.md block {i}": b for i, b in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))}
    code.update({str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "examples").rglob("*.py"))})
    return code


def test_the_readme_and_examples_import_from_the_public_api():
    shown = _user_code()
    assert len(shown) >= 3
    deep = [
        f"{where}: {mod}"
        for where, src in shown.items()
        for n in _imports(src)
        for mod in _ours(n)
        if mod != "searchrl"
    ]
    assert not deep, "deep imports shown to users:\n" + "\n".join(deep)
    for where, src in shown.items():  # and they load
        for node in _imports(src):
            if _ours(node):
                exec(compile(ast.Module([node], []), where, "exec"), {})


def test_the_pre_layer_module_paths_are_gone():
    """0.1's flat module paths (``searchrl.experiment``, ``searchrl.types``, …) were removed with their import
    hook; the changelog names where each moved."""
    for old in ("experiment", "types", "config", "cli", "train", "serving"):
        sys.modules.pop(f"searchrl.{old}", None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"searchrl.{old}")
    assert not any(type(f).__module__ == "searchrl" for f in sys.meta_path)  # no import hook of ours
