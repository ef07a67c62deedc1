"""Plots of a run's metrics (matplotlib, written as PNG)."""

from __future__ import annotations

from pathlib import Path

from searchrl.engine.metrics import read_metrics


def learning_curve(run_dir: Path, out: Path) -> Path | None:
    """SFT loss and held-out EM and, for the main algorithm, reward / train EM / held-out EM against steps
    (held-out EM: the greedy evaluations of ``trainer.eval_every``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if (run_dir / "sft" / "metrics.jsonl").exists():
        panels.append(
            ("SFT warm start", read_metrics(run_dir / "sft" / "metrics.jsonl"), ["train/loss", "eval/em"])
        )
    if (run_dir / "metrics.jsonl").exists():
        rows = read_metrics(run_dir / "metrics.jsonl")
        keys = [k for k in ("reward/mean", "train/em", "eval/em", "train/loss") if any(k in r for r in rows)]
        panels.append(("main algorithm", rows, keys))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, rows, keys) in zip(axes[0], panels):
        # a loss next to rates in [0, 1]: the loss gets its own axis on the right
        twin = ax.twinx() if "train/loss" in keys and len(keys) > 1 else None
        lines = []
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                on = twin if twin is not None and k == "train/loss" else ax
                lines += on.plot(
                    *zip(*pts), label=k, marker="." if len(pts) < 30 else None, color=f"C{keys.index(k)}"
                )
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
