"""Preemption (issue 50): SIGTERM or SIGUSR1 mid-step finishes the step, writes a checkpoint and stops with exit
code 75; `--resume` then repeats an uninterrupted run. One process here; 2 processes under DDP and ZeRO-3 in
`test_distributed.py`."""

from __future__ import annotations

import os
import signal

import pytest

from searchrl.core.config import TrainerConfig
from searchrl.engine.metrics import read_metrics
from searchrl.engine.preemption import EXIT_PREEMPTED, Preempted
from searchrl.engine.trainer import Trainer
from tests.engine.test_trainer import trainer_for


def _same(a, b):
    for ra, rb in zip(a, b):
        for k in ra:
            if not k.startswith(("time/", "mem/", "rollout/tokens_per_second")):
                assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_mid_step_saves_stops_and_resumes_exactly(make_exp, tmp_path, monkeypatch, sig):
    exp = make_exp("rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(steps=4, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=10)
    full = trainer_for(exp, "grpo", cfg, out=tmp_path / "a")
    full.run()
    original = Trainer.step

    def signalled(self, step):
        if step == 1:  # the signal arrives in the middle of step 2
            os.kill(os.getpid(), sig)
        return original(self, step)

    monkeypatch.setattr(Trainer, "step", signalled)
    cut = trainer_for(exp, "grpo", cfg, out=tmp_path / "b")
    with pytest.raises(
        Preempted, match=r"preempted by SIG\w+ after step 2: checkpoint .*step-000002 written"
    ) as e:
        cut.run()
    assert e.value.step == 2 and e.value.exit_code == EXIT_PREEMPTED == 75
    assert signal.getsignal(sig) is not cut  # the handlers were put back
    monkeypatch.setattr(Trainer, "step", original)
    resumed = trainer_for(exp, "grpo", cfg, out=tmp_path / "b", resume=True)
    assert resumed.start_step == 2
    resumed.run()
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    _same(a, b)


def test_a_save_that_would_not_fit_the_grace_period_is_skipped(make_exp, tmp_path, monkeypatch):
    """The grace period is spent: no checkpoint is started, the message names the last good one."""
    exp = make_exp("rewards=[{name: test_trainer_length}]")
    cfg = TrainerConfig(
        steps=4, batch_size=2, micro_batch_size=4, lr=1e-3, save_every=2, preempt_grace_s=1e-6
    )
    original = Trainer.step

    def signalled(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, step)

    monkeypatch.setattr(Trainer, "step", signalled)
    monkeypatch.setattr(Trainer, "_save", _slow_save)
    tr = trainer_for(exp, "grpo", cfg, out=tmp_path / "c")
    with pytest.raises(
        Preempted, match="after step 3: no checkpoint written.*the last good one is .*step-000002"
    ) as e:
        tr.run()
    assert e.value.step is None


_ORIGINAL_SAVE = Trainer._save


def _slow_save(self, done, metrics):
    _ORIGINAL_SAVE(self, done, metrics)
    self._save_s = 5.0  # a save takes 5 s here: more than the grace period left
