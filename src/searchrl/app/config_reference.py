"""The configuration reference, generated from the schema (`searchrl.core.config`): every key of an
experiment file with its type, default, range and help text, so that neither is written twice by hand.

The help text and the range are the fields' own metadata (`searchrl.core.config.setting`: ``help``, ``range``),
so the reference does not depend on how the source is laid out. Policy losses are listed from their declarations
(`searchrl.algorithms.objective`). The documentation
site builds its "Configuration" page from `markdown` (docs/hooks/config_reference.py);
``searchrl config-reference`` prints it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(t))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(t) if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if t is type(None):
        return "null"
    return getattr(t, "__name__", str(t))


def _default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def rows(cls: type, prefix: str = "", defaults: Any = None) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, help) for every field of ``cls`` and of its nested sections. The default is
    the effective one: a nested section's keys show the values of the instance its field defaults to
    (``defaults``; e.g. the warm start's trainer, made by its ``default_factory``), which the loader merges a
    partial section onto (`searchrl.core.config`)."""
    from searchrl.core.config import field_default

    hints = typing.get_type_hints(cls)
    out: list[tuple[str, str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):  # filled in by the loader, never written in a file
            continue
        key = f"{prefix}{f.name}"
        t = hints.get(f.name, f.type)
        nested = [a for a in (t, *typing.get_args(t)) if dataclasses.is_dataclass(a)]
        rng = f.metadata["range"][1] if "range" in f.metadata else ""
        choices = f.metadata.get("choices") or f.metadata.get("registry")
        if choices:
            rng = f"a registered name ({choices})" + (f"; {rng}" if rng else "")
        value = getattr(defaults, f.name) if defaults is not None else field_default(f)
        help_ = f.metadata.get("help", "")
        out.append((key, _type_name(t), _default(value), rng, help_))
        if nested and isinstance(nested[0], type) and typing.get_origin(t) is not tuple:
            out += rows(nested[0], f"{key}.", value if dataclasses.is_dataclass(value) else None)
    return out


def algorithm_rows() -> dict[str, list[tuple[str, str, str, str, str]]]:
    """Each registered algorithm's keys (``algorithm: {name: NAME, ...}``), from its ``Config`` dataclass."""
    from searchrl.algorithms import ALGORITHMS

    out = {}
    for name in sorted(ALGORITHMS.names()):
        cls = getattr(ALGORITHMS.get(name), "Config", None)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            out[name] = rows(cls, "algorithm.")
    return out


def markdown() -> str:
    """The reference page: one table per top-level section of an experiment file."""
    from searchrl.core.config import Experiment

    lines = [
        "# Configuration reference",
        "",
        "Every key of an experiment file, generated from the schema (`src/searchrl/core/config.py`) when this",
        "site is built: its type, its default, the range the loader checks, and its help, each the field's own",
        "(`core.config.setting`). Any key can be set on the command line (`searchrl train FILE key=value`); `searchrl validate FILE`",
        "checks a file without running it. A section given in part keeps the defaults of the keys it leaves out",
        "(the defaults shown, which are the section's own: the warm start's trainer has its own). The algorithm's",
        "keys (`algorithm: {name: grpo, ...}`) are its `Config` dataclass's, listed per algorithm at the end.",
        "",
    ]
    groups: dict[str, list[tuple[str, str, str, str, str]]] = {"the file itself": []}
    for row in rows(Experiment):
        key, default = row[0], row[2]
        top = key.split(".", 1)[0] if ("." in key or default == "(section)") else "the file itself"
        groups.setdefault(top, []).append(row)
    for top, group in groups.items():
        title = top if top == "the file itself" else f"`{top}`"
        lines += ["", f"## {title}", ""]
        lines += _table(group)
    for name, group in algorithm_rows().items():
        lines += ["", f"## `algorithm` with `name: {name}`", ""]
        lines += _table([row for row in group if row[0] != "algorithm.name"])
    lines += policy_loss_lines()
    return "\n".join(lines) + "\n"


def policy_loss_lines() -> list[str]:
    """The policy losses (``algorithm.policy_loss``) as they declare themselves: what each requires and the
    arguments it takes under ``algorithm.policy_loss_args``."""
    from searchrl.algorithms import POLICY_LOSSES
    from searchrl.algorithms.objective import declaration_of

    lines = [
        "",
        "## Policy losses (`algorithm.policy_loss`)",
        "",
        "Each loss's declaration (`src/searchrl/algorithms/policy_losses.py`): the aggregation it requires, whether",
        "`dual_clip` applies, and its own arguments, set under `algorithm.policy_loss_args`.",
        "",
        "| loss | requires `loss_agg` | `dual_clip` | arguments (`policy_loss_args`) |",
        "|---|---|---|---|",
    ]
    for name in POLICY_LOSSES.names():
        d = declaration_of(name)
        args = "; ".join(
            f"`{k}` (default `{v.default}`" + (f", {v.range[1]}" if v.range else "") + f"): {v.help}"
            for k, v in d.settings.items()
        )
        cells = [
            f"`{name}`",
            f"`{d.loss_agg}`" if d.loss_agg else "any",
            "yes" if d.dual_clip else "no",
            args or "none",
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def _table(group: list[tuple[str, str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | range | what it is |", "|---|---|---|---|---|"]
    for key, kind, default, rng, help_ in group:
        cells = [f"`{key}`", kind, f"`{default}`", rng, help_]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return lines
