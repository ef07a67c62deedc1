"""Balancing a step's rows over the processes (`engine.balance`): whole groups, the trainer's row count,
fewer tokens on the busiest process, the same answer on every process."""

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.core.types import Segment, Trajectory
from searchrl.engine.balance import assign, balance


def test_two_long_groups_on_one_process_are_split():
    # process 0: two groups of 2 long rows; process 1: two groups of 2 short rows
    lengths = [[100, 90, 80, 70], [10, 12, 11, 9]]
    units = [[(0, 1, 7), (0, 1, 7), (0, 1, 8), (0, 1, 8)], [(1, 1, 3), (1, 1, 3), (1, 1, 4), (1, 1, 4)]]
    plan = assign(lengths, units, rows=4)
    # longest first: 190 -> process 0, 150 -> 1, 22 -> 1 (fewer tokens), 20 -> 0 (1 is full)
    assert plan == [[(0, 0), (0, 1), (1, 2), (1, 3)], [(0, 2), (0, 3), (1, 0), (1, 1)]]
    assert assign(lengths, [[(0, 1, 7)] * 4, [(1, 1, 3)] * 4], rows=3) is None  # a group of 4 fits nowhere


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_assign_keeps_groups_whole_within_the_row_count(data):
    world = data.draw(st.integers(2, 4))
    size = data.draw(st.integers(1, 4))  # rows per group, as GRPO's group_size
    groups_per = data.draw(st.integers(1, 4))
    rows = size * groups_per
    lengths = [[data.draw(st.integers(1, 500)) for _ in range(rows)] for _ in range(world)]
    units = [[(r, 1, i // size) for i in range(rows)] for r in range(world)]
    plan = assign(lengths, units, rows)
    assert plan is not None  # equal group sizes always fit
    flat = sorted(x for mine in plan for x in mine)
    assert flat == [(r, i) for r in range(world) for i in range(rows)]  # every row exactly once
    for mine in plan:
        assert len(mine) <= rows
        assert all(
            sum(units[r][i] == u for r, i in mine) in (0, size) for u in {units[r][i] for r, i in mine}
        )
    load = [sum(lengths[r][i] for r, i in mine) for mine in plan]
    biggest = max(sum(lengths[r][i : i + size]) for r in range(world) for i in range(0, rows, size))
    assert max(load) <= sum(map(sum, lengths)) / world + biggest  # greedy's bound: the mean plus one group
    assert assign(lengths, units, rows) == plan  # deterministic: every process computes the same


class TwoProcesses:
    """An engine stand-in whose all-gather returns both processes' rows (as each process would see them)."""

    def __init__(self, rank, rows_of):
        self.rank, self.world_size, self.rows_of = rank, 2, rows_of

    def gather_objects(self, items):
        return [self.rows_of[0], self.rows_of[1]]


def traj(n, group, tag):
    return Trajectory(None, [Segment("prompt", [tag] * n)], state=SimpleNamespace(), group_id=group)


def test_balance_hands_each_process_its_share():
    rows_of = [
        [traj(100, 0, 1), traj(90, 0, 1), traj(80, 1, 2), traj(70, 1, 2)],
        [traj(10, 0, 3), traj(12, 0, 3), traj(11, 1, 4), traj(9, 1, 4)],
    ]
    got = [balance(rows_of[r], TwoProcesses(r, rows_of), rows=4) for r in (0, 1)]
    mine = [[t.segments[0].token_ids[0] for t in ts] for ts, _ in got]
    assert sorted(mine[0] + mine[1]) == [1, 1, 2, 2, 3, 3, 4, 4] and mine[0] == [1, 1, 4, 4]
    metrics = got[0][1]
    assert metrics == got[1][1] and metrics["balance/kept_in_place"] == 0.0
    assert metrics["balance/tokens_max_over_mean_before"] == 340 / 191
    assert metrics["balance/tokens_max_over_mean"] == 210 / 191
    # already even: nothing moves
    even = [[traj(50, 0, 1), traj(50, 0, 1)], [traj(50, 0, 2), traj(50, 0, 2)]]
    same = balance(even[0], TwoProcesses(0, even), rows=2)
    assert same[0] == even[0] and same[1]["balance/kept_in_place"] == 1.0
    one = SimpleNamespace(world_size=1, rank=0)
    assert balance(even[0], one, rows=2) == (even[0], {})
