"""Imports flow one way (docs/design.md §2): app → engine → algorithms → rewards → rollout → envs → models → data
→ core, the config schema at the bottom. Every import is checked, function-level ones included, and so is
every registry string (``"searchrl.pkg.module:name"``, a lazy import by another name)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "searchrl"
RANK = {
    "core": 0,
    "config": 0,
    "data": 1,
    "models": 2,
    "envs": 3,
    "rollout": 4,
    "rewards": 5,
    "algorithms": 6,
    "engine": 7,
    "app": 8,
}
# the folders of src/searchrl, each a layer (the package root holds only the lazy public API)
LAYERS = {"core", "data", "models", "envs", "rollout", "rewards", "algorithms", "engine", "app"}
# Edges still to remove. Nothing may be added here: the config schema (`config`) and the file loader
# (`loader`) reach no registry (`experiment`, in the app, checks the names).
PENDING: set[tuple[str, str]] = set()


def part(module: str) -> str:
    """Which layer a module of ours belongs to: its folder; in ``core``, the config schema and the file loader
    (``config``) are set apart below the rest."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return "app"  # the package root (lazy public API) and `python -m searchrl`
    if parts[1] == "core" and len(parts) > 2 and parts[2] in ("config", "loader"):
        return "config"
    return parts[1]


def test_the_root_holds_only_the_layers():
    """`ls src/searchrl` names the layers: folders, and no module beside the package's own two files."""
    files = {p.name for p in PKG.iterdir() if p.suffix == ".py"}
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert files == {"__init__.py", "__main__.py"}
    assert folders == LAYERS


REGISTRY_STRING = re.compile(r"^searchrl(\.\w+)+:\w+$")


def imports(registry: bool = True) -> set[tuple[str, str]]:
    """(importing module, imported module) for every import of the package and, with ``registry``, every
    registry string (a lazy import: it may point inside its own package, never up)."""
    edges = set()
    for f in PKG.rglob("*.py"):
        module = ".".join(("searchrl", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if (
                registry
                and isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and REGISTRY_STRING.match(node.value)
            ):
                edges.add((module, node.value.split(":")[0]))
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("searchrl")
            ):
                edges.add((module, str(node.module)))
            elif isinstance(node, ast.Import):
                edges.update((module, a.name) for a in node.names if a.name.startswith("searchrl"))
    return edges


def allowed(src: str, dst: str) -> bool:
    a, b = part(src), part(dst)
    if a == b:
        return True
    if b == "config":
        return True  # the schema is at the bottom
    if a == "config":
        return b == "core"
    return RANK[b] < RANK[a]


def test_the_walk_sees_imports():
    found = imports()
    assert ("searchrl.engine.trainer", "searchrl.models.policy") in found
    assert ("searchrl.envs.search", "searchrl.core.types") in found
    assert ("searchrl.rollout.summarizers", "searchrl.rollout.chat") in found  # a registry string
    assert ("searchrl.core.types", "searchrl.core.records") in found
    assert len(found) > 150


def test_imports_flow_one_way():
    bad = sorted(e for e in imports() if not allowed(*e) and e not in PENDING)
    assert not bad, "imports against docs/design.md §2's direction:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in bad
    )


def test_pending_edges_still_exist():
    """An edge removed from the code must leave PENDING too, so the list only shrinks."""
    assert imports() >= PENDING


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for src, dst in imports(registry=False) - PENDING:
        a, b = part(src), part(dst)
        if a != b:
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for n in list(graph):
        if n not in state:
            visit(n, [])


def _module_of(name: str) -> str:
    """An import target as the module file it runs: a name inside a module (``pkg.mod.attr``) is ``pkg.mod``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = PKG.parent.joinpath(*parts[:n])
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return ".".join(parts[:n])
    return name


def test_no_cycle_inside_a_package():
    """Within each folder, modules import one way too (a package's ``__init__`` counts as a module of it)."""
    graph: dict[str, set[str]] = {}
    for src, dst in imports(registry=False):
        dst = _module_of(dst)
        pkg_src = (
            src if (PKG.parent / src.replace(".", "/") / "__init__.py").exists() else src.rsplit(".", 1)[0]
        )
        pkg_dst = (
            dst if (PKG.parent / dst.replace(".", "/") / "__init__.py").exists() else dst.rsplit(".", 1)[0]
        )
        if src != dst and pkg_src == pkg_dst:
            graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(
                    " -> ".join([*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt])
                )
            elif nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles inside a package:\n" + "\n".join(cycles)


def test_no_function_over_80_lines():
    long = []
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 80:
                    long.append(f"{f.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


DECLARING_BASES = {"Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum"}


def _declares_fields(cls: ast.ClassDef) -> bool:
    """Whether bare annotations in ``cls``'s body are its own fields (a dataclass, a protocol, a named tuple,
    a typed dict, an enum), not attributes that something else sets."""
    names = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in cls.decorator_list}
    bases = {ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in cls.bases}
    return "dataclass" in names or bool(bases & DECLARING_BASES) or any("Config" in b for b in bases)


def test_no_class_declares_attributes_set_elsewhere():
    """A class that names an attribute in its body (``x: int``) without a value sets it in its own methods:
    a mixin whose attributes another class's constructor sets hides where they come from (docs/design.md §2:
    the trainer is composed of parts that receive what they use)."""
    bad = []
    for f in PKG.rglob("*.py"):
        for cls in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef) or _declares_fields(cls):
                continue
            declared = {  # class variables (``ClassVar``) are for subclasses to give
                n.target.id
                for n in cls.body
                if isinstance(n, ast.AnnAssign)
                and n.value is None
                and isinstance(n.target, ast.Name)
                and "ClassVar" not in ast.unparse(n.annotation)
            }
            assigned = {
                t.attr
                for node in ast.walk(cls)
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in ([*t.elts] if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)  # self.x, or obj.x in __new__
            }
            if declared - assigned:
                bad.append(f"{f.relative_to(PKG)}: {cls.name} declares {sorted(declared - assigned)}")
    assert not bad, "attributes declared but set elsewhere:\n" + "\n".join(bad)


def test_module_names_are_unique():
    """A module's file name says what it holds, once: no two modules of the package share one."""
    seen: dict[str, list[str]] = {}
    for f in PKG.rglob("*.py"):
        if f.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(f.name, []).append(str(f.relative_to(PKG)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}
