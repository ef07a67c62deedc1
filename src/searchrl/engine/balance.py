"""Balancing a step's rows over the processes by tokens (``trainer.balance_ranks``).

Each process rolls out its own questions, so one may hold far more tokens than another (long multi-turn
episodes against early answers), and every process waits for the slowest at each collective. After the
collection every process sees every row's length (one all-gather of the rows), and all compute the same
assignment: whole groups (a question's episodes, a state's candidates, a preference pair: the units that
advantages and pair losses are computed over) go, longest first, to the process with the fewest tokens that
still has room for them in its ``rows`` (the trainer's fixed row count, so that every process keeps the
same number of micro-batches and collectives). The loss is normalised over the global batch, so where a row
is trained does not change the update (tests/engine/test_distributed.py: the same metrics and weights).
If the greedy assignment cannot fit every group (groups of unequal sizes), or does not lower the largest
process's tokens (it is not optimal), the step keeps the rows where they were.
"""

from __future__ import annotations

from typing import Any

from searchrl.core.types import Trajectory


def _unit(traj: Trajectory, rank: int, index: int) -> tuple[int, ...]:
    """The rows that must stay together: a pair, an episode group (group ids are a process's own), or one
    dataset row."""
    if traj.pair_id >= 0:
        return (rank, 0, traj.pair_id)
    if traj.state is not None:
        return (rank, 1, traj.group_id)
    return (rank, 2, index)


def assign(
    lengths: list[list[int]], units: list[list[tuple[int, ...]]], rows: int
) -> list[list[tuple[int, int]]] | None:
    """For each process, the (source process, row index) pairs it trains on; None when the groups do not fit.
    ``lengths[r][i]`` and ``units[r][i]``: process r's row i's tokens and group."""
    world = len(lengths)
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for r in range(world):
        for i, u in enumerate(units[r]):
            groups.setdefault(u, []).append((r, i))
    size = {u: sum(lengths[r][i] for r, i in members) for u, members in groups.items()}
    order = sorted(groups, key=lambda u: (-size[u], u))
    load, used = [0] * world, [0] * world
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for u in order:
        room = [r for r in range(world) if used[r] + len(groups[u]) <= rows]
        if not room:
            return None
        r = min(room, key=lambda q: (load[q], q))
        out[r] += groups[u]
        load[r] += size[u]
        used[r] += len(groups[u])
    return [sorted(x) for x in out]


def balance(trajs: list[Trajectory], engine: Any, rows: int) -> tuple[list[Trajectory], dict[str, float]]:
    """This process's rows after balancing (see the module), and the step's token imbalance before and after
    (the largest process's tokens over the mean; the same numbers on every process)."""
    world, rank = engine.world_size, engine.rank
    if world == 1:
        return trajs, {}
    everyone: list[list[Trajectory]] = engine.gather_objects([trajs])
    lengths = [[len(t) for t in ts] for ts in everyone]
    units = [[_unit(t, r, i) for i, t in enumerate(ts)] for r, ts in enumerate(everyone)]
    plan = assign(lengths, units, rows)
    before = [sum(x) for x in lengths]
    mean = max(sum(before) / world, 1e-9)
    after = before if plan is None else [sum(lengths[r][i] for r, i in mine) for mine in plan]
    if max(after) >= max(before):  # no better than where they are (greedy is not optimal): nothing moves
        plan, after = None, before
    metrics = {
        "balance/tokens_max_over_mean_before": max(before) / mean,
        "balance/tokens_max_over_mean": max(after) / mean,
        "balance/kept_in_place": float(plan is None),  # no fit, or no gain
    }
    return (trajs if plan is None else [everyone[r][i] for r, i in plan[rank]]), metrics
