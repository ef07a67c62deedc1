"""A run directory belongs to one config: ``config.yaml`` is written once, by the run that trains there.

Re-running `searchrl train` in a directory trained with another config is refused with the keys that
differ (``--force`` starts the run over); `searchrl eval` writes its config beside its own results.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from searchrl.config import Experiment, save_resolved, to_dict
from searchrl.errors import ConfigError

# what `searchrl train` writes into output_dir (all of it is removed by --force, nothing else)
RUN_FILES = (
    "checkpoints",
    "sft",
    "final",
    "final.tmp",
    "eval",
    "world",
    "tensorboard",
    "metrics.jsonl",
    "results.json",
    "results.md",
    "learning_curve.png",
    "config.yaml",
)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resolved(exp: Experiment) -> dict[str, Any]:
    """The config as it is saved (a YAML round trip, so tuples and lists compare equal)."""
    return yaml.safe_load(yaml.safe_dump(to_dict(exp), sort_keys=False))


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    a, b = _flat(saved), _flat(now)
    return [
        f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def check_run_dir(exp: Experiment, force: bool = False) -> None:
    """Refuse to train into a directory whose saved config differs from ``exp`` (read only: every process
    can call it, so all of them refuse together)."""
    path = exp.out / "config.yaml"
    if force or not path.exists():
        return
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"the run's saved config is unreadable ({exc}); use --force to start the run over", file=str(path)
        ) from None
    diff = differences(saved, resolved(exp))
    if diff:
        shown = "\n    ".join(diff[:20]) + (f"\n    ... and {len(diff) - 20} more" if len(diff) > 20 else "")
        raise ConfigError(
            f"this run directory was trained with another config; the keys that differ:\n    {shown}",
            file=str(path),
            hint="choose another output_dir (e.g. name=NEW), or pass --force to delete this run's "
            "checkpoints and results and start over",
        )


def claim_run_dir(exp: Experiment, force: bool = False) -> Path:
    """Main process: with ``force`` clear the run's files, then write ``config.yaml`` unless it is there."""
    out = exp.out
    if force:
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    path = out / "config.yaml"
    return path if path.exists() else save_resolved(exp, out)
