"""Experiment files: YAML with ``base:`` includes (paths relative to the including file; later files and
overrides win; mappings merge, lists replace) and ``a.b=c`` command-line overrides, converted by the schema
(`searchrl.core.config`). Every error names the file (or the command line override) and the dotted key.

This module and the schema sit at the bottom: nothing here imports a registry. The names a config gives
(retrievers, rewards, algorithms, …) are checked by `searchrl.app.experiment.load_experiment`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from searchrl.core.config import Experiment, KeySources, convert
from searchrl.core.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """yaml's safe loader (no tags that build Python objects) that refuses a key given twice in one mapping:
    plain YAML keeps the last silently (a second ``trainer:`` section drops the first)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen and key != "<<":
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key '{key}' is given twice in one mapping (line {seen[key] + 1} and line "
                f"{key_node.start_mark.line + 1}); YAML would silently keep only the last",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)  # type: ignore[no-untyped-call]


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)  # type: ignore[arg-type]


def load_yaml(raw: bytes, file: str) -> Any:
    """A YAML file's data: UTF-8, safe tags only, no duplicate keys; otherwise one `ConfigError` naming the
    file and the line (a ``!!python/…`` tag is refused, never executed)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"not UTF-8 text (line {line}, byte {exc.start}: {exc.reason}); save it as UTF-8", file=file
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        where = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        problem = exc.problem or str(exc)
        if "could not determine a constructor" in problem:
            problem = f"{problem}: only plain YAML is read, tags that build Python objects are refused"
        raise ConfigError(f"{problem}{where}", file=file) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=file) from None


def _read_yaml(path: Path, ctx: KeySources, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError("config file not found", file=str(path))
    if path.is_dir():
        raise ConfigError("is a directory; pass an experiment YAML file", file=str(path))
    if path.resolve() in seen:
        raise ConfigError("circular 'base:' include", file=str(path), value=[str(p) for p in seen])
    data = load_yaml(path.read_bytes(), str(path)) or {}
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


def apply_overrides(data: dict[str, Any], overrides: list[str], ctx: KeySources) -> dict[str, Any]:
    """``a.b=c`` sets data['a']['b'] to YAML-parsed ``c``; a mapping ``c`` merges into an existing section
    (``trainer={steps: 2}`` keeps the file's other trainer keys; a different ``name`` replaces it)."""
    data = _merge({}, data)
    for item in overrides:
        key, value = parse_assignment(item)
        node = data
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            # a section the override opens: its errors are the override's, not the file's
            if not isinstance(node.get(p), dict):
                node[p] = {}
                ctx.source[".".join(parts[: i + 1])] = f"command line override '{item}'"
            node = node[p]
        old = node.get(parts[-1])  # a mapping merges into the section, as a file's `base:` does
        node[parts[-1]] = _merge({"_": old}, {"_": value})["_"] if isinstance(old, dict) else value
        ctx.source[key] = f"command line override '{item}'"
    return data


def read_experiment(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[Experiment, KeySources]:
    """The experiment a file and overrides describe, converted by the schema (types, ranges, choices), and
    the conversion's context: where each key came from and the registry names still to check
    (`searchrl.app.experiment.load_experiment` does both)."""
    ctx = KeySources()
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path), ctx)
        ctx.source[""] = str(path)
        if ctx.source.get("name") != str(Path(path)):
            # a run's name is its own file's: a file that names none gets its file's stem, not a base's name
            # (a file based on the quickstart would train into the quickstart's run directory)
            data["name"] = Path(path).stem
            ctx.source["name"] = f"{path} (its file name: `name` is not inherited from a base)"
    data = apply_overrides(data, list(overrides or []), ctx)
    refuse_secrets(data, ctx)
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


# a key's name that says it holds a secret (api_key_env, which names a variable, does not)
_SECRET_NAME = re.compile(
    r"(^|_)(api_?key|secret|password|passwd|access_token|auth_token|hf_token|bearer|authorization)$", re.I
)
# a value holding a provider's key, an Authorization header, or a key in a URL's query string
_SECRET_VALUE = re.compile(
    r"(?<![A-Za-z0-9])(sk-[A-Za-z0-9_\-]{20,}|hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,}"
    r"|xox[abpr]-[A-Za-z0-9\-]{10,}|AKIA[A-Z0-9]{16}|AIza[A-Za-z0-9_\-]{35})"
    r"|^Bearer\s+\S+|[?&](api_?key|key|token|access_token)=[^&\s]+",
    re.I,
)


def refuse_secrets(data: Any, ctx: KeySources, key: str = "") -> None:
    """Refuse a secret anywhere in a config (a file or an override): a key is read from the environment only
    (``api_key_env``: the variable's name), so that it is never written to ``config.yaml``, logs or errors.
    The error names the key, never the value."""
    if isinstance(data, dict):
        for k, v in data.items():
            sub = f"{key}.{k}" if key else str(k)
            if isinstance(v, str) and v and (_SECRET_NAME.search(str(k)) or _SECRET_VALUE.search(v.strip())):
                raise ConfigError(
                    "holds what looks like a secret (an API key or token); a config never carries one, so it "
                    "is not saved, logged or shown (not even here)",
                    # an override's source quotes it, value included: name the command line only
                    file="command line" if ctx.where(sub).startswith("command line") else ctx.where(sub),
                    key=sub,
                    hint="put the key in an environment variable and name the variable instead, e.g. "
                    "api_key_env: OPENAI_API_KEY",
                )
            refuse_secrets(v, ctx, sub)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            refuse_secrets(v, ctx, f"{key}[{i}]")
