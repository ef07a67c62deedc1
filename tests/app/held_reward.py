"""A reward for the SLURM requeue test: the F1 reward, which, in a job whose environment names a hold directory
(``SEARCHRL_TEST_HOLD``), stops the run inside its third step until the test has requeued the job.

The requeue must reach the run mid-training; a tiny run's step takes about a second, so without a hold it can
finish before the scheduler's SIGTERM arrives (it did in CI). Held, the run writes ``signalled`` in the hold
directory when the signal reaches it, and waits until the test removes ``hold``; its step then ends, the run sees
the signal at the step boundary, saves and exits 75. The score is F1's, so the held run's weights can be
compared with an unheld one's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from searchrl.rewards.contract import RewardOutput
from searchrl.rewards.outcome import f1_reward

HOLD_ENV = "SEARCHRL_TEST_HOLD"


def held_f1(traj: Any, *, answers: Sequence[str]) -> RewardOutput:
    held = os.environ.get(HOLD_ENV)
    if held:
        _hold(Path(held))
    return f1_reward(traj, answers=answers)


def _hold(d: Path) -> None:
    metrics = d / "metrics.jsonl"
    if not (d / "hold").exists() or not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        return
    previous = signal.getsignal(signal.SIGTERM)

    def noted(signum: int, frame: Any) -> None:
        (d / "signalled").touch()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, noted)
    try:
        end = time.monotonic() + 600
        while (d / "hold").exists() and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
