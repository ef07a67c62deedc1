"""Metrics sink: a progress bar with live reward/EM, JSONL every step, optional TensorBoard and W&B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsSink:
    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0, enabled: bool = True,
                 tensorboard: bool = False, wandb_project: str | None = None, desc: str = "train",
                 config: dict[str, Any] | None = None) -> None:  # fmt: skip
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

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [
            ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step
        ]
        self.path.write_text("".join(ln + "\n" for ln in keep))

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
            shown = {k.split("/")[-1]: f"{v:.3f}" for k, v in clean.items()
                     if k in ("reward/mean", "train/em", "train/loss", "eval/em")}  # fmt: skip
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
