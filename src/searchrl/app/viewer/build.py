"""`searchrl view RUN_OR_FILE [--compare OTHER] [--out DIR]`: a static HTML viewer of what a run was
evaluated and trained on, one folder that opens from disk.

What it reads:
- evaluations: ``*.predictions.jsonl`` (`searchrl.app.eval_episodes.write_results`), given as a file or found in a run
  directory (``eval/`` of `searchrl train`, the run directory itself for `searchrl eval`);
- training samples: ``samples/step-*.json`` of the run and of its warm start (``sft/samples``), written by
  the trainer (``trainer.samples``, `searchrl.engine.samples`);
- learning curves: the run's ``learning_curve.png``.

What it writes into the output folder: ``index.html``, ``viewer.js`` and ``viewer.css`` (from
``searchrl/app/viewer/static``, no CDN), ``data/main.js`` (evaluations, the paired comparison, the list of
training steps) and one ``data/STAGE-step-NNNNNN.js`` per saved step, loaded when the step is opened, so a
long run's samples do not make the first page heavy. Data files are JavaScript (``window.SEARCHRL = …``)
rather than JSON because a page opened from disk may not fetch files beside it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from searchrl.core.errors import DataError

STATIC = Path(__file__).parent / "static"
PREDICTIONS = ".predictions.jsonl"
STAGES = {"main": ".", "sft": "sft"}  # training stages with samples: name -> directory inside the run
CURVES = ("learning_curve.png",)


@dataclass
class Source:
    """What was found at one path given to `searchrl view`."""

    path: Path
    evals: dict[str, Path] = field(default_factory=dict)  # evaluation name -> predictions file
    samples: dict[str, list[Path]] = field(default_factory=dict)  # stage -> step files
    curves: list[Path] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.path.name


def eval_name(path: Path) -> str:
    return path.name[: -len(PREDICTIONS)]


def find(path: str | Path) -> Source:
    """The evaluations, training samples and curves of a run directory, or one predictions file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"searchrl view: {p} does not exist (give a run directory or a *{PREDICTIONS} file)")
    if p.is_file():
        if not p.name.endswith(PREDICTIONS):
            raise DataError(
                f"searchrl view: {p} is not an evaluation's predictions file (*{PREDICTIONS}, written by "
                "`searchrl eval` and `searchrl train`); give it or the run directory"
            )
        return Source(p, evals={eval_name(p): p})
    src = Source(p)
    for f in sorted([*p.glob(f"*{PREDICTIONS}"), *(p / "eval").glob(f"*{PREDICTIONS}")]):
        src.evals[eval_name(f)] = f
    for stage, sub in STAGES.items():
        files = sorted((p / sub / "samples").glob("step-*.json"))
        if files:
            src.samples[stage] = files
    src.curves = [p / c for c in CURVES if (p / c).is_file()]
    if not (src.evals or src.samples or src.curves):
        raise DataError(
            f"searchrl view: {p} holds nothing to show: no *{PREDICTIONS} (in it or in eval/), no "
            "samples/step-*.json (trainer.samples) and no learning_curve.png"
        )
    return src


def read_records(path: Path) -> list[dict[str, Any]]:
    """A predictions file's records; a bad line is an error naming the file and the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}, line {n}: not JSON ({exc})") from None
            if not isinstance(rec, dict) or "question" not in rec:
                raise DataError(f"{path}, line {n}: not an evaluation record (no 'question')")
            if "segments" in rec:
                rec.pop("transcript", None)  # the segments hold the same text
            out.append(rec)
    return out


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Two evaluations of the same questions, paired by id: counts of who got what right, and for EM and F1
    the paired difference a − b with its 95% bootstrap interval and p-value (`searchrl.core.stats`)."""
    from searchrl.core.stats import paired_bootstrap

    by_id = {r["id"]: r for r in b}
    ids = [r["id"] for r in a if r["id"] in by_id]
    if not ids:
        raise DataError("searchrl view --compare: the two evaluations share no question ids")
    a_by = {r["id"]: r for r in a}
    out: dict[str, Any] = {"ids": ids, "questions": len(ids)}
    for key in ("em", "f1"):
        xa = [float(a_by[i].get(key) or 0.0) for i in ids]
        xb = [float(by_id[i].get(key) or 0.0) for i in ids]
        t = paired_bootstrap([xa], [xb])
        out[key] = {
            "a": sum(xa) / len(ids),
            "b": sum(xb) / len(ids),
            "difference": t.difference.mean,
            "low": t.difference.low,
            "high": t.difference.high,
            "p": t.p_value,
        }
    ra = [bool(a_by[i].get("em")) for i in ids]
    rb = [bool(by_id[i].get("em")) for i in ids]
    out["counts"] = {
        "a_only": sum(x and not y for x, y in zip(ra, rb)),
        "b_only": sum(y and not x for x, y in zip(ra, rb)),
        "both": sum(x and y for x, y in zip(ra, rb)),
        "neither": sum(not x and not y for x, y in zip(ra, rb)),
    }
    return out


def _pick(a: Source, b: Source) -> tuple[str, str]:
    """The evaluations to pair: the same name in both, else the only one of each."""
    common = [n for n in a.evals if n in b.evals]
    if common:
        return common[-1], common[-1]
    if len(a.evals) == 1 and len(b.evals) == 1:
        return next(iter(a.evals)), next(iter(b.evals))
    raise DataError(
        f"searchrl view --compare: no evaluation of the same name in both ({sorted(a.evals)} vs "
        f"{sorted(b.evals)}); give the two *{PREDICTIONS} files"
    )


def _js(name: str, value: Any) -> str:
    return f"{name} = {json.dumps(value, ensure_ascii=False, separators=(',', ':'))};\n"


def view(target: str | Path, compare: str | Path | None = None, out: str | Path | None = None) -> Path:
    """Write the viewer for ``target`` (and ``compare``) into ``out``; returns ``out/index.html``."""
    src = find(target)
    other = find(compare) if compare is not None else None
    if other is not None and not (src.evals and other.evals):
        raise DataError("searchrl view --compare needs an evaluation (*.predictions.jsonl) on both sides")
    dest = Path(out) if out is not None else default_out(src)
    if dest.exists() and not (dest / "index.html").is_file() and any(dest.iterdir()):
        raise DataError(f"searchrl view: {dest} is not empty and holds no viewer; choose another --out")
    data_dir = dest / "data"
    if data_dir.is_dir():
        shutil.rmtree(data_dir)  # a previous view's data: rewritten whole
    data_dir.mkdir(parents=True)
    for f in ("index.html", "viewer.js", "viewer.css"):
        shutil.copyfile(STATIC / f, dest / f)

    evals: list[dict[str, Any]] = [
        {"name": n, "file": str(p), "records": read_records(p)} for n, p in src.evals.items()
    ]
    page: dict[str, Any] = {"title": src.label, "source": str(src.path), "evals": evals, "compare": None}
    if other is not None:
        na, nb = _pick(src, other)
        ra: list[dict[str, Any]] = next(e["records"] for e in evals if e["name"] == na)
        rb = read_records(other.evals[nb])
        page["compare"] = {
            "a": {"name": f"{src.label}: {na}", "records": ra},
            "b": {"name": f"{other.label}: {nb}", "records": rb},
            "stats": paired(ra, rb),
        }
    stages = []
    for stage, files in src.samples.items():
        steps = []
        for sample in files:
            try:
                rec = json.loads(sample.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise DataError(f"{sample}: not a training sample ({exc})") from None
            step = int(rec["step"])
            (data_dir / f"{stage}-step-{step:06d}.js").write_text(
                f"SEARCHRL_STEP({json.dumps(stage)}, {step}, "
                + json.dumps(rec, ensure_ascii=False, separators=(",", ":"))
                + ");\n",
                encoding="utf-8",
            )
            steps.append(step)
        stages.append({"name": stage, "steps": steps})
    page["training"] = stages
    curves = []
    for c in src.curves:
        (dest / "curves").mkdir(exist_ok=True)
        shutil.copyfile(c, dest / "curves" / c.name)
        curves.append(f"curves/{c.name}")
    page["curves"] = curves
    (data_dir / "main.js").write_text(_js("window.SEARCHRL", page), encoding="utf-8")
    return dest / "index.html"


def default_out(src: Source) -> Path:
    """``RUN/view``, or ``NAME.view`` beside a predictions file."""
    if src.path.is_file():
        return src.path.with_name(eval_name(src.path) + ".view")
    return src.path / "view"


def serve(index: Path, port: int) -> None:
    """Serve the viewer's folder on 127.0.0.1 until interrupted (the page works from disk as well)."""
    import contextlib
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(index.parent))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as httpd:
        print(f"serving {index.parent} on http://127.0.0.1:{httpd.server_address[1]}/ (Ctrl-C stops)")
        with contextlib.suppress(KeyboardInterrupt):
            httpd.serve_forever()
