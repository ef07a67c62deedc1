"""Plots of a run's metrics (matplotlib, written as PNG)."""

from __future__ import annotations

from pathlib import Path

from searchrl.engine.metrics import read_metrics


def learning_curve(run_dir: Path, out: Path) -> Path | None:
    """SFT loss and, for the main algorithm, reward / train EM / eval EM against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if (run_dir / "sft" / "metrics.jsonl").exists():
        panels.append(("SFT warm start", read_metrics(run_dir / "sft" / "metrics.jsonl"), ["train/loss"]))
    if (run_dir / "metrics.jsonl").exists():
        rows = read_metrics(run_dir / "metrics.jsonl")
        keys = [k for k in ("reward/mean", "train/em", "eval/em", "train/loss") if any(k in r for r in rows)]
        panels.append(("main algorithm", rows, keys))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, rows, keys) in zip(axes[0], panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), label=k, marker="." if len(pts) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
