"""Metrics combined over processes equal the metrics of one process holding the union of the data."""

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from searchrl.core.aggregate import Max, Mean, Sum, combine, values
from searchrl.rollout.loop import RolloutStats


def test_hand_computed():
    a = {"r": Mean(3.0, 2), "n": Sum(5), "gap": Max(0.5), "lr": 1e-3, "only_a": Mean(1.0, 4)}
    b = {"r": Mean(1.0, 6), "n": Sum(7), "gap": Max(2.0), "lr": 1e-3, "only_b": Sum(2)}
    assert combine([a, b]) == pytest.approx(
        {"r": 0.5, "n": 12.0, "gap": 2.0, "lr": 1e-3, "only_a": 0.25, "only_b": 2.0}
    )


def test_kinds_are_numbers_and_pickle():
    m = Mean(3.0, 4)
    assert m == 0.75 and isinstance(m, float) and Mean(1.0, 0) == 0.0
    back = pickle.loads(pickle.dumps(m))
    assert type(back) is Mean and (back.total, back.count) == (3.0, 4.0)
    assert values({"m": m, "s": Sum(2), "x": Max(-1.0)}) == {"m": 0.75, "s": 2.0, "x": -1.0}


def test_a_mean_over_nothing_is_left_out_and_conflicting_kinds_fail():
    assert combine([{"m": Mean(0.0, 0)}, {"m": Mean(0.0, 0)}]) == {}
    with pytest.raises(ValueError, match="reported as mean by one process and sum by another"):
        combine([{"k": 1.0}, {"k": Sum(1.0)}])


@given(
    st.lists(st.floats(-100, 100), min_size=1, max_size=40),
    st.lists(st.integers(0, 3), min_size=40, max_size=40),
)
def test_split_over_processes_equals_union(items, owner):
    """However items are split over up to 4 processes, the combined mean, sum and max are the union's."""
    procs = [[x for x, o in zip(items, owner) if o == p] for p in range(4)]
    reports = [
        {"mean": Mean(sum(p), len(p)), "sum": Sum(sum(p)), **({"max": Max(max(p))} if p else {})}
        for p in procs
    ]
    got = combine(reports)
    assert got["mean"] == pytest.approx(sum(items) / len(items), abs=1e-9)
    assert got["sum"] == pytest.approx(sum(items), abs=1e-9)
    assert got["max"] == max(items)


def test_rollout_stats_report_every_finish_reason():
    """A finish reason none of a process's episodes had is still reported (0 of its episodes), so the rate
    is over every process's episodes."""
    a, b = RolloutStats(episodes=3), RolloutStats(episodes=1)
    a.finish_reasons.update(["answer", "answer", "length"])
    b.finish_reasons.update(["eos"])
    got = combine([a.metrics(), b.metrics()])
    assert got["rollout/finish_answer"] == 0.5 and got["rollout/finish_eos"] == 0.25
    assert got["rollout/finish_length"] == 0.25 and got["rollout/finish_budget"] == 0.0


def test_merge_keeps_kinds_and_pools_means():
    from searchrl.core.aggregate import Max, Mean, Sum, combine, merge

    a = {"m": Mean(3, 2), "s": Sum(5), "x": Max(1.0), "only_a": Mean(1, 1)}
    b = {"m": Mean(1, 2), "s": Sum(2), "x": Max(4.0)}
    out = merge([a, b])
    assert isinstance(out["m"], Mean) and (out["m"].total, out["m"].count) == (4.0, 4.0)
    assert isinstance(out["s"], Sum) and out["s"] == 7 and isinstance(out["x"], Max) and out["x"] == 4.0
    assert combine([out]) == combine([a, b])  # one merged report reduces like the two
    with pytest.raises(ValueError, match="reported as"):
        merge([{"k": Sum(1)}, {"k": Max(1)}])
