"""Plots of a run's metrics (matplotlib, written as PNG)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from searchrl.engine.metrics import read_metrics

RATES = ("reward/mean", "train/em", "eval/em")  # drawn on the left axis, in [0, 1] for EM rewards


@dataclass(frozen=True)
class Series:
    """One line of a panel: ``label`` (metric names joined by " = " where they are equal at every step)."""

    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    right_axis: bool = False  # the loss, on its own axis
    baseline: bool = False  # a dashed horizontal line at ``values[0]``


def curve_panels(run_dir: Path) -> list[tuple[str, list[Series]]]:
    """What `learning_curve` draws: an SFT panel (loss, held-out EM) and a main panel (reward, train EM,
    held-out EM, loss; the SFT stage's final held-out EM as a baseline). Metrics equal at every step (an EM
    reward makes ``reward/mean`` and ``train/em`` the same numbers) are one series."""
    panels = []
    sft_em = None
    if (run_dir / "sft" / "metrics.jsonl").exists():
        rows = read_metrics(run_dir / "sft" / "metrics.jsonl")
        panels.append(("SFT warm start", _series(rows, ["train/loss", "eval/em"])))
        sft_em = next((r["eval/em"] for r in reversed(rows) if "eval/em" in r), None)
    if (run_dir / "metrics.jsonl").exists():
        rows = read_metrics(run_dir / "metrics.jsonl")
        series = _series(rows, [*RATES, "train/loss"])
        if sft_em is not None and series:
            steps = [s for x in series for s in x.steps]
            series.append(
                Series("SFT held-out EM", (min(steps), max(steps)), (sft_em, sft_em), baseline=True)
            )
        panels.append(("main algorithm", series))
    return [p for p in panels if p[1]]


def _series(rows: list[dict[str, Any]], keys: list[str]) -> list[Series]:
    out: list[Series] = []
    for k in keys:
        pts = [(int(r["step"]), float(r[k])) for r in rows if k in r]
        if not pts:
            continue
        steps, values = (tuple(x) for x in zip(*pts))
        same = next((i for i, s in enumerate(out) if (s.steps, s.values) == (steps, values)), None)
        if same is not None:  # one line for metrics that are the same numbers
            out[same] = Series(f"{out[same].label} = {k}", steps, values, out[same].right_axis)
        else:
            out.append(Series(k, steps, values, right_axis=k == "train/loss"))  # type: ignore[arg-type]
    if all(s.right_axis for s in out):  # a loss alone keeps the left axis
        out = [Series(s.label, s.steps, s.values) for s in out]
    return out


def learning_curve(run_dir: Path, out: Path) -> Path | None:
    """`curve_panels` of ``run_dir`` side by side, as a PNG at ``out`` (None when there are no metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = curve_panels(run_dir)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        twin = ax.twinx() if any(s.right_axis for s in series) else None
        lines = []
        for i, s in enumerate(series):
            on = twin if s.right_axis and twin is not None else ax
            if s.baseline:
                lines.append(on.axhline(s.values[0], color="grey", linestyle="--", label=s.label))
                continue
            marker = "." if len(s.steps) < 30 else None
            lines += on.plot(s.steps, s.values, label=s.label, marker=marker, color=f"C{i}")
        if twin is not None:
            twin.set_ylabel("train/loss")
            ax.set_ylabel("reward, EM")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(lines, [ln.get_label() for ln in lines])
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
