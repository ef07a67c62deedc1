"""Preemption: a job that SLURM or Kubernetes takes back gets SIGTERM (SLURM's ``--signal`` sends SIGUSR1 ahead
of time), then SIGKILL after a grace period. On either signal the run finishes the step in progress, writes a
checkpoint on every process (the same collective sequence as a periodic one), and stops with exit code 75
(``EX_TEMPFAIL``: "preempted, resume me"); ``searchrl train --resume`` continues from that checkpoint exactly as
an uninterrupted run would have.

The signal may reach one process alone: at every step boundary the processes agree on whether any of them got
one (a maximum over one number, in the same place on every process), so they stop together. The save is
skipped, with a message, when it would not fit in ``trainer.preempt_grace_s`` (counted from the signal, the
save's time estimated from the run's earlier saves): the last good checkpoint then stays the newest.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

from searchrl.core.errors import SearchRLError

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, try again
SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None
)


class Preempted(SearchRLError):
    """The run stopped on a preemption signal; ``step`` is the checkpoint it saved (None: none fitted)."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, summary: str, step: int | None) -> None:
        super().__init__(f"{summary}; continue with `searchrl train … --resume` (exit code {EXIT_PREEMPTED})")
        self.summary = summary  # what happened, without how to continue (`searchrl launch` says that)
        self.step = step


class Preemption:
    """Catches the preemption signals while a run trains (`watch`), and says when one arrived."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signal: int | None = None
        self.at: float | None = None  # monotonic time of the first signal
        self._previous: dict[int, Any] = {}
        self.stopping = False  # the run stops on a signal: later ones are ignored while it exits

    def watch(self) -> None:
        """Install the handlers (the main thread only: Python delivers signals there; elsewhere, e.g. a run
        started from a worker thread, the job's default handling stays)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def unwatch(self) -> None:
        """The previous handlers back; or, once the run stops on a preemption (``stopping``), the signals
        ignored: a launcher's follow-up SIGTERM (torchrun sends one to the processes still running when another
        has exited) must not kill a process that has saved and is exiting with code 75."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.stopping else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal, self.at = signum, time.monotonic()

    def agreed(self, engine: Any) -> bool:
        """Whether any process got a signal: a collective every process issues at each step boundary."""
        return _any(engine, self.signal is not None)

    def save_fits(self, engine: Any, estimate_s: float) -> bool:
        """Whether a save of about ``estimate_s`` seconds fits in every process's grace period (agreed: the
        save is collective)."""
        return not _any(engine, self.left_s() < estimate_s)

    def left_s(self) -> float:
        """Seconds of the grace period left (all of it where this process got no signal itself)."""
        if self.at is None:
            return self.grace_s
        return self.grace_s - (time.monotonic() - self.at)

    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a peer's signal"


def _any(engine: Any, flag: bool) -> bool:
    """``flag`` on any process (a sum over the processes where there are several)."""
    if engine.world_size > 1:
        return bool(engine.sum(1.0 if flag else 0.0) > 0)
    return flag
