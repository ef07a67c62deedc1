"""Experiment files: YAML with ``base:`` includes (paths relative to the including file; later files and
overrides win; mappings merge, lists replace) and ``a.b=c`` command-line overrides, converted by the schema
(`searchrl.config`). Every error names the file (or the command line override) and the dotted key.

This module and the schema sit at the bottom: nothing here imports a registry. The names a config gives
(retrievers, rewards, algorithms, …) are checked by `searchrl.experiment.load_experiment`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from searchrl.config import Ctx, Experiment, convert
from searchrl.errors import ConfigError


def _read_yaml(path: Path, ctx: Ctx, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError("config file not found", file=str(path))
    if path.is_dir():
        raise ConfigError("is a directory; pass an experiment YAML file", file=str(path))
    if path.resolve() in seen:
        raise ConfigError("circular 'base:' include", file=str(path), value=[str(p) for p in seen])
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8", file=str(path)
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            "the top level must be a mapping of sections", file=str(path), value=type(data).__name__
        )
    bases = data.pop("base", None) or []
    if not (isinstance(bases, str) or (isinstance(bases, list) and all(isinstance(b, str) for b in bases))):
        raise ConfigError(
            "base is a path (relative to this file) or a list of paths",
            file=str(path),
            key="base",
            value=bases,
        )
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = (path.parent / base).resolve()
        if not base_path.exists():
            raise ConfigError("base config not found", file=str(path), key="base", value=str(base))
        merged = _merge(merged, _read_yaml(base_path, ctx, (*seen, path.resolve())))
    ctx.record(data, str(path))
    return _merge(merged, data)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``b`` over ``a``, recursively. A mapping that names a different ``name`` (another algorithm, reward
    or retriever) replaces the old one instead of inheriting arguments that belong to it."""
    out = dict(a)
    for k, v in b.items():
        old = out.get(k)
        same = (
            isinstance(v, dict)
            and isinstance(old, dict)
            and v.get("name", old.get("name")) == old.get("name")
        )
        out[k] = _merge(old, v) if same else v  # type: ignore[arg-type]
    return out


def parse_assignment(
    item: str, what: str = "an override", example: str = "section.key=value"
) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, YAML-parsed value): the one parser of config overrides, ``--arg`` and world
    settings on the command line. An empty value is None."""
    key, eq, raw = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"{what} must look like '{example}'", file="command line", value=item)
    try:
        return key, (yaml.safe_load(raw) if raw.strip() else None)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"value is not valid YAML: {exc}", file="command line", key=key, value=raw
        ) from None


def apply_overrides(data: dict[str, Any], overrides: list[str], ctx: Ctx) -> dict[str, Any]:
    """``a.b=c`` sets data['a']['b'] to YAML-parsed ``c``; a mapping ``c`` merges into an existing section
    (``trainer={steps: 2}`` keeps the file's other trainer keys; a different ``name`` replaces it)."""
    data = _merge({}, data)
    for item in overrides:
        key, value = parse_assignment(item)
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        old = node.get(parts[-1])  # a mapping merges into the section, as a file's `base:` does
        node[parts[-1]] = _merge({"_": old}, {"_": value})["_"] if isinstance(old, dict) else value
        ctx.source[key] = f"command line override '{item}'"
    return data


def read_experiment(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[Experiment, Ctx]:
    """The experiment a file and overrides describe, converted by the schema (types, ranges, choices), and
    the conversion's context: where each key came from and the registry names still to check
    (`searchrl.experiment.load_experiment` does both)."""
    ctx = Ctx()
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path), ctx)
        ctx.source[""] = str(path)
    data = apply_overrides(data, list(overrides or []), ctx)
    exp = convert(Experiment, data, ctx, "")
    try:
        exp.out  # noqa: B018 (the placeholders must resolve)
    except (KeyError, IndexError, ValueError) as exc:
        raise ctx.error(
            "output_dir",
            f"cannot fill in the path ({type(exc).__name__}: {exc})",
            value=exp.output_dir,
            hint="the only placeholder is {name}, e.g. runs/{name}",
        ) from None
    return exp, ctx
