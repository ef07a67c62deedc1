"""A run directory belongs to one config: ``config.yaml`` is written once, by the run that trains there.

Re-running `searchrl train` in a directory trained with another config is refused with the keys that
differ (``output_dir`` aside, so a moved run directory resumes); a killed run re-run without ``--resume``
is refused too. ``--force`` starts the run over: it deletes only what a searchrl run writes (`run_files`),
and only in a directory that holds a run's ``config.yaml``. `searchrl eval` writes its config beside its
own results.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from searchrl.core.config import Experiment, save_resolved, to_dict
from searchrl.core.errors import ConfigError

# what `searchrl train` writes into output_dir and into a warm start's stage directory (sft/)
STAGE_FILES = (
    "checkpoints",
    "final",
    "final.tmp",
    "tensorboard",
    "metrics.jsonl",
    "guards.json",
    "samples",  # trainer.samples (`engine.samples`)
)
# view/: `searchrl view RUN`'s default output, stale once the run starts over
ROOT_FILES = (*STAGE_FILES, "results.json", "results.md", "learning_curve.png", "config.yaml", "view")
STAGE_DIRS = ("sft",)
# eval/NAME-SPLIT.{json,md,predictions.jsonl,hotpot.json,config.yaml} (`searchrl.app.eval_episodes.write_results`)
EVAL_FILE = re.compile(r"^.+-(train|dev|test)\.(json|md|predictions\.jsonl|hotpot\.json|config\.yaml)$")
TEACHER_FILE = re.compile(r"^teacher-\d+\.jsonl$")
WORLD_FILES = ("world.json", "corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl")


def run_files(out: Path) -> list[Path]:
    """The files and directories under ``out`` that `searchrl train` writes and nothing else: a user's
    notes beside them (``eval/notes.md``, ``world/my_world.json``) are not among them."""
    found = [out / n for n in ROOT_FILES if (out / n).exists()]
    for stage in STAGE_DIRS:
        d = out / stage
        found += [d / n for n in STAGE_FILES if (d / n).exists()]
        found += sorted(p for p in d.glob("teacher-*.jsonl") if TEACHER_FILE.match(p.name))
    found += sorted(p for p in (out / "eval").glob("*") if p.is_file() and EVAL_FILE.match(p.name))
    found += sorted(p for p in out.glob("*.config.yaml") if EVAL_FILE.match(p.name))  # `searchrl eval`'s
    world = out / "world"
    found += [world / n for n in WORLD_FILES if (world / n).exists()]
    found += sorted(p for p in world.glob("model-*") if p.is_dir())
    return found


def _remove(out: Path, paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for sub in (*STAGE_DIRS, "eval", "world"):  # left empty by the removal: gone too
        d = out / sub
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


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


def check_run_dir(exp: Experiment, force: bool = False, resume: bool = False) -> None:
    """Refuse to train into a directory whose saved config differs from ``exp`` (``output_dir`` aside), to
    start a killed run over without ``--resume`` or ``--force``, and (``force``) to delete anything in a
    directory that is not a run's. Read only: every process calls it, so all of them refuse together."""
    out = exp.out
    path = out / "config.yaml"
    if force:
        mine = run_files(out)
        if mine and not path.is_file():
            shown = "\n    ".join(str(p) for p in mine[:20]) + (
                f"\n    ... and {len(mine) - 20} more" if len(mine) > 20 else ""
            )
            raise ConfigError(
                f"--force deletes a run's files only in a directory that holds the run's config.yaml, and "
                f"{out} has none; it would have deleted:\n    {shown}",
                key="output_dir",
                value=str(out),
                hint="move those files, or choose another output_dir (e.g. name=NEW); nothing was deleted",
            )
        return
    if path.exists():
        try:
            saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"the run's saved config is unreadable ({exc}); use --force to start the run over",
                file=str(path),
            ) from None
        diff = [d for d in differences(saved, resolved(exp)) if not d.startswith("output_dir:")]
        if diff:
            shown = "\n    ".join(diff[:20]) + (
                f"\n    ... and {len(diff) - 20} more" if len(diff) > 20 else ""
            )
            raise ConfigError(
                f"this run directory was trained with another config; the keys that differ:\n    {shown}",
                file=str(path),
                hint="choose another output_dir (e.g. name=NEW), or pass --force to delete this run's "
                "checkpoints and results and start over",
            )
    if not resume:
        stopped = _unfinished(out)
        if stopped is not None:
            raise ConfigError(
                f"{stopped} holds the checkpoints of a run that did not finish; training again from step 0 "
                "would overwrite them",
                key="output_dir",
                value=str(out),
                hint="pass --resume to continue from its newest checkpoint, or --force to start over",
            )


def _unfinished(out: Path) -> Path | None:
    """The checkpoints directory of a stage that saved some but exported no final model, if any."""
    from searchrl.engine.checkpoint import has_weights

    for d in (out / s for s in (*STAGE_DIRS, "")):
        ckpts = d / "checkpoints"
        if ckpts.is_dir() and any(ckpts.glob("step-*")) and not has_weights(d / "final"):
            return ckpts
    return None


def claim_run_dir(exp: Experiment, force: bool = False) -> Path:
    """Main process: with ``force`` delete the run's files (`run_files`; `check_run_dir` has made sure the
    directory is a run's), then write ``config.yaml`` unless it is there."""
    out = exp.out
    if force:
        _remove(out, run_files(out))
    path = out / "config.yaml"
    return path if path.exists() else save_resolved(exp, out)
