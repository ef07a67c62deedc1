"""Collapse guards: a deliberately unstable GRPO run (learning rate far too high) collapses without them;
with them it stops naming the monitor and the last good checkpoint, or rolls back and recovers."""

import json

import pytest

from searchrl.config import GuardConfig, GuardsConfig, TrainerConfig
from searchrl.engine.guards import Guards, GuardTrip
from searchrl.engine.metrics import read_metrics
from tests.engine.test_trainer import trainer_for

UNSTABLE_LR = 0.05  # 50x a sane rate for this model: the policy's entropy falls to ~0 within a few steps
WARMUP = 2  # the rate rises linearly over the first steps, so that the run is healthy before it collapses
ENTROPY = GuardConfig(metric="entropy", min=0.5, window=2)


def run(make_exp, agent_model_dir, guards: GuardsConfig, steps: int = 8):
    exp = make_exp(
        f"model.path={agent_model_dir}", "rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]"
    )
    cfg = TrainerConfig(
        steps=steps,
        batch_size=4,
        micro_batch_size=16,
        lr=UNSTABLE_LR,
        save_every=1,
        keep_checkpoints=3,
        guards=guards,
        warmup_steps=WARMUP,
    )
    return exp, trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0})


def test_guards_check_windowed_means_and_non_finite_values():
    g = Guards(
        [
            GuardConfig(metric="entropy", min=0.5, window=2),
            GuardConfig(metric="train/kl", max=1.0, window=1, after=2),
        ]
    )
    assert g.check(1, {"train/entropy": 0.4, "train/kl": 5.0}) is None  # window not full; kl not armed yet
    assert (
        g.check(2, {"train/entropy": 0.7, "train/kl": 5.0}) is None
    )  # mean 0.55; kl still unarmed at step 2
    trip = g.check(3, {"train/entropy": 0.2, "train/kl": 0.1})  # mean(0.7, 0.2) = 0.45 < 0.5
    assert (trip.monitor, trip.metric, trip.window) == ("entropy", "train/entropy", 2)
    assert trip.value == pytest.approx(0.45)
    assert (
        "guard 'entropy' (train/entropy) mean over the last 2 steps is 0.45, below min 0.5" in trip.describe()
    )
    g.reset()
    assert g.check(4, {"train/entropy": 0.1, "train/kl": 0.5}) is None  # refilling after a reset
    assert g.check(5, {"train/entropy": 2.0, "train/kl": 3.0}).monitor == "train/kl"
    assert g.check(6, {"train/entropy": float("nan")}).bound == "finite"
    with pytest.raises(ValueError, match="needs a bound"):
        GuardConfig(metric="entropy")


def test_an_unstable_run_collapses_without_guards(make_exp, agent_model_dir):
    exp, tr = run(make_exp, agent_model_dir, GuardsConfig())
    tr.run()
    ent = [r["train/entropy"] for r in read_metrics(exp.out / "metrics.jsonl")]
    # healthy at first, then collapsed: near-zero entropy, and low on average at the end (it may flicker
    # back up for a step, as on CI's CPU: 0.11, 0.62, 0.24)
    assert ent[0] > 1.0 and min(ent[1:]) < 0.25 and sum(ent[-3:]) / 3 < 0.5, ent
    assert not (exp.out / "guards.json").exists()


def test_the_guard_stops_an_unstable_run_naming_the_monitor_and_checkpoint(make_exp, agent_model_dir):
    exp, tr = run(make_exp, agent_model_dir, GuardsConfig(monitors=(ENTROPY,), on_trip="stop"))
    with pytest.raises(
        GuardTrip,
        match=r"collapse guard at step (\d+): guard 'entropy'.*the last good checkpoint is .*step-0+\d",
    ):
        tr.run()
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert len(trips) == 1 and trips[0]["action"] == "stop" and trips[0]["monitor"] == "entropy"
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert rows[-1]["step"] == trips[0]["step"] and rows[-1]["guard/trips"] == 1.0  # the trip is logged
    # the window's values (steps T-1, T) come from the policies saved at T-2 and T-1: the good one is T-3
    assert trips[0]["checkpoint"].endswith(f"step-{trips[0]['step'] - 3:06d}")


def test_the_guard_rolls_back_and_the_run_recovers(make_exp, agent_model_dir):
    guards = GuardsConfig(monitors=(ENTROPY,), on_trip="rollback", lr_scale=0.02, max_rollbacks=2)
    exp, tr = run(make_exp, agent_model_dir, guards)
    tr.run()  # finishes: rolled back to the last good checkpoint with lr x0.02 (0.001, a healthy rate)
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert [t["action"] for t in trips] == ["rollback"] and trips[0]["lr_scale"] == 0.02
    assert trips[0]["discarded_metrics"]  # the collapsed steps, kept beside the run
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))  # one record per step: the discarded ones left
    assert min(r["train/entropy"] for r in rows[-3:]) > 0.5  # recovered: no collapse at the end
    assert rows[-1]["guard/trips"] == 1.0 and rows[-1]["train/lr"] == pytest.approx(UNSTABLE_LR * 0.02)
    assert (exp.out / "final").exists()
