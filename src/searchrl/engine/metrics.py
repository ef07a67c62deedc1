"""Metrics sink: a progress bar with live reward/EM, JSONL every step, optional TensorBoard and W&B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from searchrl.core.errors import SearchRLError


class MetricsSink:
    def __init__(
        self,
        out_dir: Path,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        desc: str = "train",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if start_step == 0:
            self.path.write_text("")
        else:  # resumed: drop records past the checkpoint so the file matches an uninterrupted run
            self._truncate_after(start_step)
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(out_dir), config=config, resume="allow")

    def _truncate_after(self, step: int) -> list[dict[str, Any]]:
        """Drop the records past ``step``; returns them."""
        if not self.path.exists():
            return []
        rows = read_metrics(self.path)
        keep = [json.dumps(r, sort_keys=True) for r in rows if r["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))
        return [r for r in rows if r["step"] > step]

    def rewind(self, step: int) -> list[dict[str, Any]]:
        """Training continues from ``step`` (a rollback): later records leave the file (returned) and the
        progress bar goes back."""
        if not self.enabled:
            return []
        dropped = self._truncate_after(step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()
        return dropped

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, int | float) else v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._bar is not None:
            self._bar.set_postfix(progress_fields(clean), refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress_fields(metrics: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows: reward and EM for RL; loss, learning rate and trained tokens per second
    where there is no reward (SFT, DPO, PRM); the latest evaluation EM."""
    shown = {
        k.split("/")[-1]: f"{metrics[k]:.3f}"
        for k in ("reward/mean", "train/em", "train/loss")
        if k in metrics
    }
    if "reward/mean" not in metrics:
        if "train/lr" in metrics:
            shown["lr"] = f"{metrics['train/lr']:.1e}"
        if "time/tokens_per_s" in metrics:
            shown["tok/s"] = f"{metrics['time/tokens_per_s']:.0f}"
    if "eval/em" in metrics:
        shown["eval_em"] = f"{metrics['eval/em']:.3f}"
    for k, v in metrics.items():  # judge / summarizer requests that failed this step
        if k.startswith("service/") and k.endswith("/failures") and v:
            shown[f"{k.split('/')[1]}_fail"] = f"{v:.0f}"
    return shown


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a torn last line (a run killed mid-write) is dropped."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    records = []
    for i, ln in enumerate(lines):
        try:
            records.append(json.loads(ln))
        except ValueError:
            if i == len(lines) - 1:
                break
            raise SearchRLError(f"{path}: line {i + 1} is not JSON ({ln[:60]!r})") from None
    return records
