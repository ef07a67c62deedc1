"""`searchrl report RUN_OR_SWEEP_DIR... --out DIR`: a table, plots and an offline HTML page.

Runs are found under the given directories (any directory with ``metrics.jsonl``) and grouped into
variants by name, with a trailing ``-seed<N>`` removed. The table gives mean ± std over seeds of the final
evaluation (``results.json``: every stage but the untrained model) per variant, and a 95% bootstrap
interval of EM over questions and seeds from the per-question predictions (`searchrl.core.stats`). The
comparisons pair two arms (variant, stage) on the same questions and seeds: the stages of one variant
against its warm start, and each stage across variants, with a paired-bootstrap p-value; differences
with p < 0.05 are marked. The plots give training curves and held-out EM (``trainer.eval_every``) against
steps and against generated tokens, one line per variant (mean over seeds) with a min-max band.
"""

from __future__ import annotations

import html
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

CURVES = {
    "reward/mean": "reward",
    "train/em": "train EM",
    "rollout/response_tokens": "response length (generated tokens per episode)",
    "rollout/searches_per_episode": "searches per episode",
    "train/kl": "KL to the reference",
    "train/entropy": "entropy",
    "train/clip_frac": "clip fraction",
    "eval/em": "held-out EM (trainer.eval_every, greedy)",
}
ALPHA = 0.05
TABLE = ("em", "f1", "sub_em", "searches_per_question", "invalid_action_rate", "gold_doc_recall")


def find_runs(paths: list[str | Path]) -> dict[str, Path]:
    runs: dict[str, Path] = {}
    for p in map(Path, paths):
        for m in sorted(
            [p / "metrics.jsonl"] if (p / "metrics.jsonl").exists() else p.rglob("metrics.jsonl")
        ):
            if m.parent.name == "sft" and (m.parent.parent / "metrics.jsonl").exists():
                continue  # a warm-start stage inside a run
            runs[m.parent.name] = m.parent
    return runs


def failed_runs(paths: list[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """The runs a sweep under ``paths`` recorded as failed (``sweep.json``): they have no results to show,
    and a report must say they are missing rather than average over the runs that finished."""
    out = []
    for p in map(Path, paths):
        for f in sorted([p / "sweep.json"] if (p / "sweep.json").exists() else p.rglob("sweep.json")):
            try:
                status = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            out += [(n, st) for n, st in sorted(status.items()) if st.get("status") == "failed"]
    return out


def variant_of(run: str) -> str:
    return re.sub(r"-seed\d+$", "", run)


def seed_of(run: Path) -> int:
    """The run's seed: from its name (``-seed<N>``), else its resolved config, else 0."""
    m = re.search(r"-seed(\d+)$", run.name)
    if m:
        return int(m.group(1))
    cfg = run / "config.yaml"
    if cfg.exists():
        import yaml

        return int((yaml.safe_load(cfg.read_text()) or {}).get("seed", 0))
    return 0


def question_scores(run: Path, metrics: dict[str, Any], key: str = "em") -> dict[str, float] | None:
    """{question id: score} of one evaluated stage (its ``results.json`` entry ``metrics``), from its
    predictions file (None when it has none)."""
    from searchrl.app.eval_episodes import read_predictions

    rel = metrics.get("predictions")
    if not rel or not (run / rel).exists():
        return None
    return {str(p["id"]): float(p[key]) for p in read_predictions(run / rel)}


def arms(
    groups: dict[str, list[Path]], key: str = "em"
) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """{(variant, stage): {seed: {question id: score}}} for every stage with per-question predictions."""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = defaultdict(dict)
    for var, runs in groups.items():
        for r in runs:
            for stage, metrics in final_evals(r).items():
                scores = question_scores(r, metrics, key)
                if scores:
                    out[(var, stage)][seed_of(r)] = scores
    return dict(out)


def interval(per_seed: dict[int, dict[str, float]]) -> Any:
    """A bootstrap interval over the seeds and the questions all of them answered."""
    from searchrl.core.stats import align, bootstrap_ci

    matrix, _ = align(per_seed, per_seed)
    return bootstrap_ci(matrix) if matrix and matrix[0] else None


def comparisons(data: dict[tuple[str, str], dict[int, dict[str, float]]], key: str = "em") -> str:
    """Paired bootstrap between arms (`arms`) on the same (seed, question) pairs: each stage of a variant
    against its warm start (``sft``), and each stage across every two variants."""
    from searchrl.core.stats import align, paired_bootstrap

    pairs = [(a, b) for a in data for b in data if a[0] == b[0] and b[1] == "sft" and a[1] != "sft"]
    pairs += [(a, b) for a in data for b in data if a[1] == b[1] and a[0] < b[0]]
    lines = [
        f"| a | b | seeds | questions | {key} a − b [95% CI] | p | significant (p < {ALPHA}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in pairs:
        ma, mb = align(data[a], data[b])
        if not ma or not ma[0]:
            continue
        t = paired_bootstrap(ma, mb)
        mark = "**yes**" if t.significant(ALPHA) else "no"
        lines.append(
            f"| {a[0]} / {a[1]} | {b[0]} / {b[1]} | {len(ma)} | {len(ma[0])} | {t.difference} "
            f"| {t.p_value:.4f} | {mark} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def load_rows(run: Path) -> list[dict[str, Any]]:
    from searchrl.engine.metrics import read_metrics

    rows = read_metrics(run / "metrics.jsonl")
    tokens = 0.0
    for r in rows:
        tokens += r.get("rollout/tokens_generated", 0.0)
        r["generated_tokens"] = tokens
        eps = r.get("train/sequences", 0.0)
        if "rollout/tokens_generated" in r and eps and "rollout/response_tokens" not in r:
            r["rollout/response_tokens"] = r["rollout/tokens_generated"] / eps
    return rows


def final_evals(run: Path) -> dict[str, dict[str, Any]]:
    """The run's evaluated stages (``results.json``) but the untrained model: {stage: metrics}."""
    f = run / "results.json"
    if not f.exists():
        return {}
    return {k: v for k, v in json.loads(f.read_text()).items() if k != "untrained"}


def table(
    groups: dict[str, list[Path]], per_question: dict[tuple[str, str], dict[int, dict[str, float]]]
) -> str:
    lines = [
        "| variant | stage | seeds | " + " | ".join(TABLE) + " | em 95% CI (questions x seeds) |",
        "|---|---|---" + "|---" * (len(TABLE) + 1) + "|",
    ]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for var, runs in groups.items():
        for r in runs:
            for stage, m in final_evals(r).items():
                rows[(var, stage)].append(m)
    for (var, stage), evals in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "sft", kv[0][1])):
        cells = []
        for k in TABLE:
            vals = [float(e[k]) for e in evals if isinstance(e.get(k), int | float)]
            if not vals:
                cells.append("–")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f}")
        ci = interval(per_question[(var, stage)]) if (var, stage) in per_question else None
        cells.append(str(ci) if ci is not None else "–")
        lines.append(f"| {var} | {stage} | {len(evals)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compact_count(x: float) -> str:
    """Axis label for a count: 950, 12k, 120k, 1.5M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.0f}"


def html_table(md: str) -> str:
    """A markdown table as HTML rows: the header in <thead> with <th scope="col">, each row's first cell a
    row header (<th scope="row">), the rest data cells."""
    lines = [
        ln.strip().strip("|").split("|") for j, ln in enumerate(md.splitlines()) if j != 1 and ln.strip()
    ]
    if not lines:
        return ""
    head = "".join(f'<th scope="col">{html.escape(c.strip())}</th>' for c in lines[0])
    body = "".join(
        f'<tr><th scope="row">{html.escape(cells[0].strip())}</th>'
        + "".join(f"<td>{html.escape(c.strip())}</td>" for c in cells[1:])
        + "</tr>\n"
        for cells in lines[1:]
    )
    return f"<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>"


def plot(groups: dict[str, list[Path]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {var: [load_rows(r) for r in runs] for var, runs in groups.items()}
    files = []
    for key, label in CURVES.items():
        if not any(key in row for runs in data.values() for rows in runs for row in rows):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for x_key, ax in zip(("step", "generated_tokens"), axes):
            for var, runs in sorted(data.items()):
                series = [[(r[x_key], r[key]) for r in rows if key in r] for rows in runs]
                series = [s for s in series if s]
                if not series:
                    continue
                n = min(len(s) for s in series)
                xs = [statistics.mean(s[i][0] for s in series) for i in range(n)]
                ys = [[s[i][1] for s in series] for i in range(n)]
                line = ax.plot(xs, [statistics.mean(y) for y in ys], label=var)[0]
                if len(series) > 1:
                    ax.fill_between(
                        xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2, color=line.get_color()
                    )
            ax.set_xlabel("step" if x_key == "step" else "generated tokens")
            if x_key == "generated_tokens":
                from matplotlib.ticker import FuncFormatter

                ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: compact_count(x)))
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{label} (mean over seeds, band: min-max)")
        fig.tight_layout()
        f = out / f"{key.replace('/', '_')}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


def report(paths: list[str | Path], out: str | Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(
            f"no runs (directories with metrics.jsonl) under {', '.join(map(str, paths))}"
        )
    groups: dict[str, list[Path]] = defaultdict(list)
    for name, path in runs.items():
        groups[variant_of(name)].append(path)
    per_question = arms(groups)
    md = table(groups, per_question)
    paired = comparisons(per_question)
    pngs = plot(groups, out)
    text = md + "\n\n"
    failed = failed_runs(paths)
    missing = "".join(
        f"- {name}: exit code {st.get('returncode')}, log {st.get('log')}\n" for name, st in failed
    )
    if failed:
        text += f"**{len(failed)} sweep run(s) failed and are not in the table:**\n\n{missing}\n"
        print(f"{len(failed)} sweep run(s) failed and are not in the table:\n{missing}", end="")
    if paired:
        text += f"Paired bootstrap (same questions, same seeds; {ALPHA} two-sided):\n\n{paired}\n\n"
    (out / "report.md").write_text(text + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    rows = html_table(md)
    paired_html = (
        f"<h2>Paired comparisons (bootstrap over questions and seeds)</h2><table>{html_table(paired)}</table>"
        if paired
        else ""
    )
    failed_html = (
        f"<p><b>{len(failed)} sweep run(s) failed and are not in the table:</b> "
        + html.escape(", ".join(f"{n} (exit {st.get('returncode')})" for n, st in failed))
        + "</p>"
        if failed
        else ""
    )
    imgs = "".join(
        f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>{html.escape(p.stem)}</figcaption></figure>\n'
        for p in pngs
    )
    (
        out / "index.html"
    ).write_text(f"""<!doctype html><html><head><meta charset="utf-8"><title>searchrl report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:right}}img{{max-width:100%}}figure{{margin:1em 0}}</style></head><body>
<h1>searchrl report</h1><p>{len(runs)} runs in {len(groups)} variants: {html.escape(", ".join(sorted(groups)))}</p>
<h2>Final evaluation (mean ± std over seeds)</h2><table>{rows}</table>{failed_html}{paired_html}
<h2>Training curves</h2>{imgs}</body></html>
""")
    return out / "index.html"
