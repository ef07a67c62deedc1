"""Collapse guards. The trainer's stop and rollback are driven by a forced collapse (the entropy a step reports
is set on a schedule, as a function of the step and the learning rate in force), so that which step trips,
which checkpoint is named and how the run recovers are exact on any machine. One real run at a learning rate
far too high is kept as a slow test, asserting only that the entropy leaves its healthy band in some
direction: on one CPU it fell to ~0, on another it rose to near-uniform (2.43, 2.39, 3.73, 6.88, 7.09)."""

import json
import math

import pytest

from searchrl.core.config import GuardConfig, GuardsConfig, TrainerConfig
from searchrl.engine.engine import NonFiniteError
from searchrl.engine.guards import Guards, GuardTrip
from searchrl.engine.metrics import read_metrics
from tests.engine.test_trainer import trainer_for

UNSTABLE_LR = 0.05  # 50x a sane rate for this model: its entropy leaves the healthy band within a few steps
LR = 1e-3  # the forced runs train at a sane rate; their collapse is the scheduled entropy below
WARMUP = 2  # the rate rises linearly over the first steps, so that the run is healthy before it collapses
ENTROPY = GuardConfig(metric="entropy", min=0.5, window=2)
COLLAPSE_AT = 4  # forced runs report a collapsed entropy from this step on while the rate is above SAFE_LR
SAFE_LR = LR / 10
HEALTHY, COLLAPSED = 2.0, 0.05
# entropy sequences of the same unstable run on two CPUs: down to ~0 (CI), up to near-uniform (issue 28)
FELL = [2.41, 0.11, 0.62, 0.24, 0.09, 0.05]
ROSE = [2.43, 2.39, 3.73, 6.88, 7.09, 4.40]
BAND = (GuardConfig(metric="entropy", min=0.5, window=2), GuardConfig(metric="entropy", max=5.0, window=2))


def run(make_exp, agent_model_dir, guards: GuardsConfig, steps: int = 8, lr: float = LR, save_every: int = 1):
    exp = make_exp(
        f"model.path={agent_model_dir}", "rollout.temperature=1.0", "rewards=[{name: test_trainer_length}]"
    )
    cfg = TrainerConfig(
        steps=steps,
        batch_size=4,
        micro_batch_size=16,
        lr=lr,
        save_every=save_every,
        keep_checkpoints=3,
        guards=guards,
        warmup_steps=WARMUP,
    )
    return exp, trainer_for(exp, "grpo", cfg, args={"kl_coef": 0.0})


def force_collapse(tr):
    """The trainer's steps run for real; the entropy each reports is COLLAPSED from step COLLAPSE_AT on
    while the learning rate in force is above SAFE_LR (the rate a rollback scales down), else HEALTHY."""
    real = tr.step
    seen = []

    def step(i):
        metrics = real(i)
        lr = tr.optimizer.param_groups[0]["lr"]
        metrics["train/entropy"] = COLLAPSED if i + 1 >= COLLAPSE_AT and lr > SAFE_LR else HEALTHY
        seen.append((i + 1, metrics["train/entropy"]))
        return metrics

    tr.step = step
    return seen


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


def test_a_drop_guard_trips_when_the_reward_falls_from_its_best():
    """``max_drop``: the windowed mean may not fall more than that below the highest it reached; a reward that
    only climbs or plateaus never trips, and a rollback (reset) measures the best again."""
    g = Guards([GuardConfig(metric="reward", max_drop=0.25, window=2)])
    rewards = [0.3, 0.5, 0.7, 0.8, 0.75, 0.6, 0.4]  # window means 0.4, 0.6, 0.75, 0.775, 0.675, 0.5
    trips = [g.check(step, {"reward/mean": r}) for step, r in enumerate(rewards, 1)]
    assert trips[:6] == [None] * 6  # 0.775 − 0.5 = 0.275 only at step 7
    t = trips[6]
    assert (t.step, t.monitor, t.metric, t.value) == (7, "reward", "reward/mean", pytest.approx(0.5))
    assert "0.275 below its best 0.775 (max_drop 0.25)" in t.describe()
    g.reset()
    assert all(g.check(s, {"reward/mean": r}) is None for s, r in enumerate([0.4, 0.35, 0.3, 0.2], 8))
    climb = Guards([GuardConfig(metric="reward", max_drop=0.01, window=3)])
    assert all(climb.check(s, {"reward/mean": 0.1 * s}) is None for s in range(1, 30))
    GuardConfig(metric="reward", max_drop=0.2)  # a drop alone is a bound


def test_an_entropy_guard_rests_while_the_reward_is_high():
    """``unless_reward_above``: a policy sure of itself because it succeeds has converged, not collapsed (the
    tool quickstart's GRPO: entropy 0.004 at reward 0.95); the same entropy at a low reward trips, and a
    window with too few rewards (a run without them) checks as usual."""
    g = Guards([GuardConfig(metric="entropy", min=0.005, window=3, unless_reward_above=0.9)])
    steps = [(0.012, 0.8), (0.004, 0.95), (0.004, 0.97), (0.003, 0.96), (0.004, 0.98)]  # converging
    assert all(
        g.check(s, {"train/entropy": e, "reward/mean": r}) is None for s, (e, r) in enumerate(steps, 1)
    )
    trip = g.check(6, {"train/entropy": 0.004, "reward/mean": 0.5})  # rewards (0.96, 0.98, 0.5): mean 0.81
    assert trip is not None and trip.bound == "below min 0.005" and trip.value == pytest.approx(0.011 / 3)
    g.reset()
    assert [g.check(s, {"train/entropy": 0.001}) for s in (7, 8)] == [None, None]  # refilling, no rewards
    assert g.check(9, {"train/entropy": 0.001}).monitor == "entropy"
    plain = Guards([GuardConfig(metric="entropy", min=0.005, window=3)])
    trips = [plain.check(s, {"train/entropy": e, "reward/mean": r}) for s, (e, r) in enumerate(steps, 1)]
    # without it, the converging run trips
    assert trips[3].step == 4 and trips[3].value == pytest.approx(0.011 / 3)


def first_trip(monitors, values):
    g = Guards(list(monitors))
    return next((t for step, v in enumerate(values, 1) if (t := g.check(step, {"train/entropy": v}))), None)


def test_a_band_guard_trips_whichever_way_the_entropy_leaves():
    """The two recorded sequences of one unstable run: a min-only guard misses the rise, a band catches both."""
    assert first_trip(BAND[:1], FELL).bound == "below min 0.5" and first_trip(BAND[:1], ROSE) is None
    fell, rose = first_trip(BAND, FELL), first_trip(BAND, ROSE)
    assert (fell.step, fell.value) == (3, pytest.approx((0.11 + 0.62) / 2))
    assert (rose.step, rose.bound, rose.value) == (4, "above max 5", pytest.approx((3.73 + 6.88) / 2))


def test_the_guard_stops_a_collapsing_run_naming_the_monitor_and_checkpoint(make_exp, agent_model_dir):
    exp, tr = run(make_exp, agent_model_dir, GuardsConfig(monitors=(ENTROPY,), on_trip="stop"))
    force_collapse(tr)
    # step 4: mean(2.0, 0.05) = 1.025 is healthy; step 5: mean(0.05, 0.05) trips
    with pytest.raises(
        GuardTrip,
        match=r"collapse guard at step 5: guard 'entropy'.*the last good checkpoint is .*step-000002",
    ):
        tr.run()
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert len(trips) == 1 and trips[0]["action"] == "stop" and trips[0]["monitor"] == "entropy"
    assert trips[0]["step"] == 5 and trips[0]["value"] == pytest.approx(COLLAPSED)
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1][
        "guard/trips"
    ] == 1.0  # the trip is logged
    # the window's values (steps 4, 5) come from the policies saved at 3 and 4: the good one is step 2
    assert trips[0]["checkpoint"].endswith("step-000002")
    assert not (exp.out / "final").exists()


def test_the_guard_rolls_back_and_the_run_recovers(make_exp, agent_model_dir):
    guards = GuardsConfig(monitors=(ENTROPY,), on_trip="rollback", lr_scale=0.02, max_rollbacks=2)
    exp, tr = run(make_exp, agent_model_dir, guards)
    seen = force_collapse(tr)
    tr.run()  # finishes: rolled back to step 2 with lr x0.02 (below SAFE_LR: healthy from then on)
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert [t["action"] for t in trips] == ["rollback"] and trips[0]["lr_scale"] == 0.02
    assert trips[0]["step"] == 5 and trips[0]["checkpoint"].endswith("step-000002")
    discarded = trips[0]["discarded_metrics"]  # the collapsed steps, kept beside the run
    assert [(r["step"], r["train/entropy"]) for r in discarded] == [
        (3, HEALTHY),
        (4, COLLAPSED),
        (5, COLLAPSED),
    ]
    # steps 3-5 ran again from the restored checkpoint, then 6-8
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))  # one record per step: the discarded ones left
    assert all(r["train/entropy"] == HEALTHY for r in rows)  # recovered: no collapse kept
    assert rows[-1]["guard/trips"] == 1.0 and rows[-1]["train/lr"] == pytest.approx(LR * 0.02)
    assert (exp.out / "final").exists()


def test_a_trip_before_the_first_save_rolls_back_to_the_start(make_exp, agent_model_dir):
    """With ``on_trip: rollback`` the run saves its starting point, so a trip before the first periodic
    checkpoint goes back to step 0 (it used to stop: nothing to roll back to)."""
    guards = GuardsConfig(monitors=(ENTROPY,), on_trip="rollback", lr_scale=0.02, max_rollbacks=2)
    exp, tr = run(make_exp, agent_model_dir, guards, save_every=100)
    seen = force_collapse(tr)
    tr.run()
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert [(t["step"], t["action"]) for t in trips] == [(5, "rollback")]
    assert trips[0]["checkpoint"].endswith("step-000000")
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5, *range(1, 9)]  # from the start again, at the lower rate
    rows = read_metrics(exp.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)) and all(r["train/entropy"] == HEALTHY for r in rows)


def test_rollbacks_stop_at_max_rollbacks(make_exp, agent_model_dir):
    """A collapse the lower rate does not cure (lr_scale 0.5 stays above SAFE_LR) rolls back once, then stops."""
    guards = GuardsConfig(monitors=(ENTROPY,), on_trip="rollback", lr_scale=0.5, max_rollbacks=1)
    exp, tr = run(make_exp, agent_model_dir, guards)
    force_collapse(tr)
    with pytest.raises(GuardTrip, match=r"max_rollbacks = 1 reached"):
        tr.run()
    trips = json.loads((exp.out / "guards.json").read_text())["trips"]
    assert [(t["step"], t["action"]) for t in trips] == [(5, "rollback"), (5, "stop")]


@pytest.mark.slow
def test_a_real_unstable_run_leaves_the_healthy_band(make_exp, agent_model_dir):
    """The real thing, without guards: at 50x a sane rate the entropy leaves [0.25, 2] x its first value,
    downwards (collapse to one token) or upwards (to near-uniform), or the loss goes non-finite; which of
    these happens depends on the CPU's floating-point path."""
    exp, tr = run(make_exp, agent_model_dir, GuardsConfig(), lr=UNSTABLE_LR)
    try:
        tr.run()
    except NonFiniteError:
        return  # diverged to inf/nan: the trainer stopped with a message, which is also leaving the band
    ent = [r["train/entropy"] for r in read_metrics(exp.out / "metrics.jsonl")]
    assert all(math.isfinite(e) for e in ent), ent
    lo, hi = 0.25 * ent[0], 2.0 * ent[0]
    assert min(ent[1:]) < lo or max(ent[1:]) > hi, ent
    assert not (exp.out / "guards.json").exists()
